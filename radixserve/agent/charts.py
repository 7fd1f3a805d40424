"""Small inline-SVG time charts for the ops page: a line (hit rate, TTFT p99) or bars (anomalies, actions); no scripts, no external files."""
from __future__ import annotations

import datetime
import html
import math
from dataclasses import dataclass
from typing import Callable

WIDTH, HEIGHT = 300, 120
LEFT, RIGHT, TOP, BOTTOM = 46, 10, 10, 22     # plot margins (px)


@dataclass(frozen=True)
class Series:
    """`points`: (step start, wall-clock s; value or None) oldest first; `kind`: "line" | "bars"."""

    key: str
    title: str
    points: list[tuple[float, float | None]]
    kind: str
    fmt: Callable[[float], str]
    y_max: float | None = None


def nice_ceiling(x: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k at or above `x` (> 0)."""
    exp = 10.0 ** math.floor(math.log10(x))
    return next(m * exp for m in (1, 2, 2.5, 5, 10) if m * exp >= x * (1 - 1e-9))


def summary(s: Series) -> str:
    values = [v for _, v in s.points if v is not None]
    if not values:
        return "—"
    if s.kind == "bars":
        return f"{s.fmt(sum(values))} in the last hour"
    return f"latest {s.fmt(values[-1])} · max {s.fmt(max(values))}"


def render(s: Series, now: float, span_s: float, step_s: float, gap_s: float) -> str:
    """A <figure> with an <svg class="chart" data-series=key data-points=n> of `s` over [now - span_s, now]."""
    values = [(t, v) for t, v in s.points if v is not None and t + step_s > now - span_s]
    top = s.y_max or nice_ceiling(max((v for _, v in values), default=0.0) or 1.0)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(t: float) -> float:
        return LEFT + plot_w * min(max((t - (now - span_s)) / span_s, 0.0), 1.0)

    def y(v: float) -> float:
        return TOP + plot_h * (1.0 - min(max(v / top, 0.0), 1.0))

    parts = [f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(f):.1f}" '
             f'y2="{y(f):.1f}"/><text class="ylab" x="{LEFT - 4}" y="{y(f) + 4:.1f}">'
             f'{html.escape(s.fmt(f))}</text>' for f in (0.0, top / 2, top)]
    for frac, label in ((0.0, f"{span_s / 60:.0f} min ago"), (0.5, f"{span_s / 120:.0f} min ago"),
                        (1.0, "now")):
        anchor = ("start", "middle", "end")[int(frac * 2)]
        parts.append(f'<text class="xlab" x="{LEFT + plot_w * frac:.1f}" y="{HEIGHT - 6}" '
                     f'text-anchor="{anchor}">{label}</text>')
    if not values:
        parts.append(f'<text class="empty" x="{LEFT + plot_w / 2:.1f}" y="{TOP + plot_h / 2:.1f}" '
                     'text-anchor="middle">no data in the last hour</text>')
    elif s.kind == "bars":
        width = max(plot_w * step_s / span_s, 2.0)
        for t, v in values:
            if v > 0:
                parts.append(f'<rect class="bar" x="{x(t):.1f}" y="{y(v):.1f}" width="{width:.1f}" '
                             f'height="{y(0.0) - y(v):.1f}"><title>{_clock(t)}: '
                             f'{html.escape(s.fmt(v))}</title></rect>')
    else:
        parts += _line(values, x, y, step_s, gap_s)
    label = html.escape(f"{s.title}: {summary(s)}")
    return (f'<figure><figcaption>{html.escape(s.title)} <b>{html.escape(summary(s))}</b>'
            f'</figcaption><svg class="chart {s.kind}" data-series="{html.escape(s.key)}" '
            f'data-points="{len(values)}" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
            f'height="{HEIGHT}" role="img" aria-label="{label}">{"".join(parts)}</svg></figure>')


def _line(values: list[tuple[float, float]], x: Callable[[float], float],
          y: Callable[[float], float], step_s: float, gap_s: float) -> list[str]:
    """A path through the points, broken over gaps above `gap_s`; a lone point is a dot."""
    runs: list[list[tuple[float, float]]] = []
    for t, v in values:
        if runs and t - runs[-1][-1][0] <= gap_s:
            runs[-1].append((t, v))
        else:
            runs.append([(t, v)])
    out = []
    for run in runs:
        xy = [(x(t + step_s / 2), y(v)) for t, v in run]
        if len(xy) == 1:
            out.append(f'<circle class="dot" cx="{xy[0][0]:.1f}" cy="{xy[0][1]:.1f}" r="2.5"/>')
        else:
            d = " ".join(f"{'L' if i else 'M'}{px:.1f},{py:.1f}" for i, (px, py) in enumerate(xy))
            out.append(f'<path class="line" d="{d}"/>')
    return out


def _clock(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%H:%M UTC")
