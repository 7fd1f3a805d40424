"""Reads the agent's ops page as a person sees it: visible text, table rows, tiles and charts (for the page tests, from the server's HTML or from Chromium's DOM)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from html.parser import HTMLParser

HIDDEN = ("head", "script", "style", "title")   # <title> in SVG is a hover tooltip


@dataclass
class Chart:
    """One <svg class="chart">: its data-points count, the coordinates its lines pass
    through, its dots and its bars."""

    points: int
    coords: int = 0
    dots: int = 0
    bars: int = 0


@dataclass
class PageView:
    text: str = ""
    rows: list[list[str]] = field(default_factory=list)
    tiles: dict[str, str] = field(default_factory=dict)
    charts: dict[str, Chart] = field(default_factory=dict)

    def rows_with(self, *words: str) -> list[list[str]]:
        """Table rows (cell texts) that contain every one of `words`."""
        return [r for r in self.rows if all(any(w in c for c in r) for w in words)]


class _Reader(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.view = PageView()
        self.chunks: list[str] = []
        self.hidden = 0
        self.row: list[str] | None = None
        self.cell: list[str] | None = None
        self.tile: list[str] | None = None
        self.chart: Chart | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag in HIDDEN:
            self.hidden += 1
        elif tag == "tr":
            self.row = []
        elif tag in ("td", "th"):
            self.cell = []
        elif tag == "div" and "tile" in classes:
            self.tile = []
        elif tag == "svg" and "chart" in classes:
            self.chart = self.view.charts[a["data-series"]] = Chart(int(a["data-points"]))
        elif self.chart and tag == "path" and "line" in classes:
            self.chart.coords += len(re.findall(r"[ML][\d.]+,[\d.]+", a["d"]))
        elif self.chart and tag == "circle" and "dot" in classes:
            self.chart.dots += 1
        elif self.chart and tag == "rect" and "bar" in classes and float(a["height"]) > 0:
            self.chart.bars += 1

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag in HIDDEN:
            self.hidden -= 1

    def handle_endtag(self, tag):
        if tag in HIDDEN:
            self.hidden -= 1
        elif tag in ("td", "th") and self.cell is not None and self.row is not None:
            self.row.append(" ".join(" ".join(self.cell).split()))
            self.cell = None
        elif tag == "tr" and self.row is not None:
            self.view.rows.append(self.row)
            self.row = None
        elif tag == "div" and self.tile is not None:
            name, *value = self.tile
            self.view.tiles[name] = " ".join(value)
            self.tile = None
        elif tag == "svg":
            self.chart = None

    def handle_data(self, data):
        if self.hidden or not data.strip():
            return
        self.chunks.append(data.strip())
        for part in (self.cell, self.tile):
            if part is not None:
                part.append(data.strip())


def read_page(html_text: str) -> PageView:
    reader = _Reader()
    reader.feed(html_text)
    reader.close()
    reader.view.text = " ".join(reader.chunks)
    return reader.view
