"""The ops page (/status.html): the fleet at a glance, each worker, decisions with their evidence, the last hour as charts; server-rendered from /status's content, no scripts, no external files."""
from __future__ import annotations

import datetime
import html
import math

from radixserve.agent.charts import Series, render

DASH = "—"
ACTING = ("drain", "isolate", "restart", "undrain", "set_policy_params")
CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1f2328;
background:#f6f8fa}
header,section{background:#fff;border-bottom:1px solid #d0d7de;padding:12px 20px}
section{margin:12px 20px;border:1px solid #d0d7de;border-radius:8px;overflow-x:auto}
h1{font-size:19px;margin:0}h2{font-size:15px;margin:0 0 8px}
.sub,.quiet td,figcaption,.ev small{color:#59636e}.sub{font-size:12px}
.banner{margin:10px 0 0;padding:8px 12px;border-radius:6px;font-weight:600}
.ok.banner{background:#dafbe1;color:#116329}.warn.banner{background:#fff8c5;color:#7d4e00}
.bad.banner{background:#ffebe9;color:#a40e26}
.tiles{display:flex;gap:10px;margin-top:10px;flex-wrap:wrap}
.tile{border:1px solid #d0d7de;border-radius:6px;padding:4px 14px;min-width:92px}
.tile b{display:block;font-size:22px}.tile.warn{border-color:#d4a72c}.tile.bad{border-color:#cf222e}
table{border-collapse:collapse;width:100%}th,td{text-align:left;padding:4px 8px;
border-bottom:1px solid #eaeef2;vertical-align:top}th{font-size:12px;color:#59636e}
td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.warn td:first-child{border-left:4px solid #d4a72c}
tr.bad td:first-child{border-left:4px solid #cf222e}
.badge{display:inline-block;padding:0 7px;border-radius:10px;background:#eaeef2;font-weight:600}
.badge.act{background:#ddf4ff;color:#0550ae}.badge.alert{background:#ffebe9;color:#a40e26}
.err{color:#a40e26}.busy{color:#7d4e00}.charts{display:flex;flex-wrap:wrap;gap:16px}figure{margin:0}
svg.chart{background:#fff;border:1px solid #eaeef2;border-radius:4px}
.grid{stroke:#eaeef2}.ylab{font-size:10px;fill:#59636e;text-anchor:end}
.xlab{font-size:10px;fill:#59636e}
path.line{fill:none;stroke:#0969da;stroke-width:1.8}circle.dot{fill:#0969da}rect.bar{fill:#bc4c00}
.empty{font-size:12px;fill:#8c959f}
"""


def esc(value: object) -> str:
    return html.escape(str(value))


def show(value: object) -> str:
    """A value as a person reads it, HTML-escaped ("—" for None and empty)."""
    if value is None or value == "" or value == [] or value == {} or value == ():
        return DASH
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return DASH if not math.isfinite(value) else esc(f"{value:.3g}")
    if isinstance(value, (list, tuple)):
        return ", ".join(show(v) for v in value)
    if isinstance(value, dict):
        return " · ".join(f"{esc(k)} {show(v)}" for k, v in value.items())
    return esc(value)


def pct(value: float | None) -> str:
    return DASH if value is None else f"{value:.0%}"


def ms(value: float | None) -> str:
    if value is None:
        return DASH
    if value == 0:
        return "0 ms"
    return f"{value:.1f} ms" if value < 10 else f"{value:.0f} ms" if value < 1000 else \
        f"{value / 1e3:.3g} s"


def count(value: float) -> str:
    return f"{value:g}"


def rotation(row: dict) -> str | None:
    """"out" | "draining" | "in" for the router's rotation; None when the router does not list it."""
    if row["state"] in ("isolated", "restarted"):
        return "out"
    if row["state"] == "draining" or row.get("draining") is True:
        return "draining"
    if row.get("router_healthy") is None:
        return None
    return "in" if row["router_healthy"] is True else "out"


def status_html(status: dict) -> str:
    """The whole page for a /status dict (app.status_json); refreshes itself."""
    refresh = max(5, math.ceil(status["sweep_interval_s"]))
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<meta http-equiv="refresh" content="{refresh}"><title>radixserve ops agent</title>'
            f'<style>{CSS}</style></head><body>{_header(status)}{_fleet(status)}'
            f'{_charts(status)}{_decisions(status)}</body></html>')


def _header(status: dict) -> str:
    rows = status["workers"]
    n = len(rows)
    places = [rotation(r) for r in rows]
    healthy = sum(r.get("alive") is True for r in rows)
    counts = {p: places.count(p) for p in ("in", "draining", "out")}
    tiles = [("Workers", n, "ok"), ("Healthy", f"{healthy}/{n}", "ok" if healthy == n else "bad"),
             ("In rotation", f"{counts['in']}/{n}", "ok" if counts["in"] == n else "warn"),
             ("Draining", counts["draining"], "warn" if counts["draining"] else "ok"),
             ("Out of rotation", counts["out"], "bad" if counts["out"] else "ok"),
             ("Panic", "yes" if status["panic"] else "no", "bad" if status["panic"] else "ok")]
    age = (f"last sweep {status['now'] - status['last_sweep_at']:.0f} s ago"
           if status.get("last_sweep_at") is not None else "no sweep yet")
    sub = (f"router {status['router']} · sweep {status['sweeps']} every "
           f"{status['sweep_interval_s']:g} s · {age} · "
           f"{'dry run: decides, never acts' if status['dry_run'] else 'acting'} · "
           f"{'supervising restarts' if status['supervise'] else 'not supervising'} · "
           f"{status['gpu']}")
    kind, text = _banner(status, rows, healthy, counts)
    return (f'<header><h1>radixserve ops agent</h1><div class="sub">{esc(sub)}</div>'
            f'<div class="banner {kind}">{esc(text)}</div><div class="tiles">'
            + "".join(f'<div class="tile {k}">{esc(name)}<b>{esc(v)}</b></div>'
                      for name, v, k in tiles) + "</div></header>")


def _banner(status: dict, rows: list[dict], healthy: int, counts: dict) -> tuple[str, str]:
    n = len(rows)
    if status.get("router_error"):
        return "bad", f"Router unreachable: {status['router_error']}; the agent waits for it."
    if status["panic"]:
        return "bad", (f"Panic: {healthy} of {n} workers answer /health; the agent only "
                       "alerts, it takes nothing out.")
    if not n:
        return "warn", ("Waiting for the first sweep." if status.get("last_sweep_at") is None
                        else "The router lists no workers.")
    out = [r for r in rows if rotation(r) != "in" or r.get("alive") is not True
           or r["state"] != "observe"]
    if not out:
        return "ok", f"All {n} workers healthy and in rotation."
    return ("bad" if counts["out"] or healthy < n else "warn"), (
        f"{counts['in']} of {n} workers in rotation. "
        + "; ".join(f"{r['url']}: {_why_out(r)}" for r in out) + ".")


def _why_out(row: dict) -> str:
    if row["state"] != "observe":
        return row["state"] + (f" ({row['fault']})" if row.get("fault") else "")
    place = rotation(row)
    if place == "draining":
        who = row.get("drained_by")   # None from a router that does not say
        return f"drained by the {who}" if isinstance(who, str) else "drained, not by the agent"
    if place == "out":
        return "unhealthy at the router"
    return f"/health failing ({row.get('health_error') or 'no answer'})"


def _fleet(status: dict) -> str:
    window = f"{status['window_s']:g} s"
    head = ["Worker", "Agent state", "Health", "Rotation", "Breaker", "In flight", "Queue",
            "KV used", f"Hit rate ({window})", f"TTFT p99 ({window})", "TTFT mean", "ITL mean",
            "Findings"]
    body = []
    for r in status["workers"]:
        state = r["state"] + (f" · {r['fault']}" if r.get("fault") else "")
        state += f" · ejected {r['ejections']}×" if r.get("ejections") else ""
        error = show(r.get("health_error") or "failing")
        health = ("ok" if r.get("health_ok") else DASH if r.get("health_ok") is None else
                  f'<span class="busy">busy: {error}, still generating</span>' if r.get("alive")
                  else f'<span class="err">{error}</span>')
        place = rotation(r)
        kind = ("bad" if r.get("alive") is False or place == "out" else
                "warn" if place == "draining" or r["state"] != "observe" else "")
        cells = [f"<b>{esc(r['url'])}</b>", esc(state), health, show(place), show(r.get("breaker")),
                 show(r.get("in_flight")), show(r.get("queue")), pct(r.get("token_usage")),
                 pct(r.get("hit_rate")), ms(r.get("ttft_p99_ms")), ms(r.get("ttft_ms")),
                 ms(r.get("itl_ms")), show(r.get("findings"))]
        body.append(f'<tr class="{kind}">' + "".join(
            f'<td class="num">{c}</td>' if 5 <= i <= 11 else f"<td>{c}</td>"
            for i, c in enumerate(cells)) + "</tr>")
    if not body:
        body = [f'<tr><td colspan="{len(head)}">No workers seen yet.</td></tr>']
    return ('<section><h2>Fleet</h2><table><thead><tr>'
            + "".join(f"<th>{esc(h)}</th>" for h in head)
            + "</tr></thead><tbody>" + "".join(body) + "</tbody></table></section>")


def _charts(status: dict) -> str:
    points = status["timeline"]

    def series(key: str) -> list[tuple[float, float | None]]:
        return [(p["t"], p[key]) for p in points]
    charts = [Series("hit_rate", "Hit rate", series("hit_rate"), "line", lambda v: f"{v:.0%}", 1.0),
              Series("ttft_p99", "TTFT p99", series("ttft_p99_ms"), "line", lambda v: ms(v)),
              Series("anomalies", "Output anomalies", series("anomalies"), "bars", count),
              Series("actions", "Agent actions", series("actions"), "bars", count)]
    step = status["timeline_step_s"]
    gap = 2.5 * max(step, status["sweep_interval_s"])
    return (f'<section><h2>Last hour, whole fleet <span class="sub">(one point per {step:g} s)'
            '</span></h2><div class="charts">' + "".join(
                render(s, status["now"], status["timeline_span_s"], step, gap) for s in charts)
            + "</div></section>")


def _decisions(status: dict) -> str:
    head = ["Time (UTC)", "Action", "Worker", "Why", "Evidence", "Result"]
    body = []
    for d, first, times in _runs(list(reversed(status["recent_decisions"]))):
        action = d.get("action") or "none"
        badge = "act" if action in ACTING else "alert" if action == "alert" else ""
        moved = (f"<br><small>{esc(d['state_from'])} → {esc(d['state_to'])}</small>"
                 if d.get("state_from") and d.get("state_from") != d.get("state_to") else "")
        result = d.get("result")
        result_cell = (DASH if result in (None, "", "-") else
                       f'<span class="err">{esc(result)}</span>' if str(result).startswith("failed")
                       else f'<span title="{esc(result)}">{esc(str(result).split(":")[0])}</span>')
        when = _clock(d.get("time")) if times == 1 else f'{_clock(first)}–{_clock(d.get("time"))}'
        again = f" <small>({times} times)</small>" if times > 1 else ""
        cells = [when, f'<span class="badge {badge}">{esc(action)}</span>{moved}',
                 esc(d.get("worker") or "fleet"), show(d.get("reason")) + again, _evidence(d),
                 result_cell]
        body.append(f'<tr class="{"" if badge else "quiet"}">'
                    + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    if not body:
        body = [f'<tr><td colspan="{len(head)}">No decisions yet.</td></tr>']
    return ('<section><h2>Recent decisions <span class="sub">(newest first; grey: did nothing)'
            '</span></h2><table><thead><tr>' + "".join(f"<th>{esc(h)}</th>" for h in head)
            + "</tr></thead><tbody>" + "".join(body) + "</tbody></table></section>")


def _runs(newest_first: list[dict]) -> list[tuple[dict, object, int]]:
    """(newest record, oldest time, count) per run of records with the same worker and reason."""
    out: list[tuple[dict, object, int]] = []
    for d in newest_first:
        if out and d.get("action") == "none" and out[-1][0].get("action") == "none" and \
                (d.get("worker"), d.get("reason")) == (out[-1][0].get("worker"),
                                                       out[-1][0].get("reason")):
            out[-1] = (out[-1][0], d.get("time"), out[-1][2] + 1)
        else:
            out.append((d, d.get("time"), 1))
    return out


def _evidence(d: dict) -> str:
    lines = [f'<b>{esc(f.get("kind"))}</b>: {show(f.get("text"))}<br><small>'
             f'{show(f.get("evidence"))}</small>' for f in d.get("findings") or []]
    seen = d.get("observed") or {}
    if seen:
        router = seen.get("router") or {}
        lines.append("<small>seen: /health " + ("ok" if seen.get("health_ok") else
                                                show(seen.get("health_error")))
                     + f" · breaker {show(router.get('breaker'))} · in flight "
                     f"{show(router.get('in_flight'))}</small>")
    if d.get("params"):
        lines.append(f"<small>set {show(d['params'])}</small>")
    return "<br>".join(lines) or DASH


def _clock(iso: object) -> str:
    try:
        t = datetime.datetime.fromisoformat(str(iso))
    except ValueError:
        return show(iso)
    return f'<span title="{esc(iso)}">{t.strftime("%H:%M:%S")}</span>'
