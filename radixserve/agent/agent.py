"""The ops agent's control loop: observe the fleet, evaluate the rules, step the ladder, act, log every decision."""
from __future__ import annotations

import asyncio
import datetime
import json
import logging
import math
import pathlib
import time
from collections import deque
from typing import Callable

from radixserve.agent import rules
from radixserve.agent.actions import Actions
from radixserve.agent.config import AgentConfig, LadderConfig, RuleConfig
from radixserve.agent.ladder import Decision, FleetView, Ladder
from radixserve.agent.metrics import AgentMetrics
from radixserve.agent.observe import FleetSnapshot, History, Observer
from radixserve.agent.timeline import Timeline
from radixserve.router.client import AsyncRouterAdminClient
from radixserve.router.worker import AGENT

logger = logging.getLogger("radixserve.agent")


def _drained(snap: FleetSnapshot, by_agent: bool) -> list[str]:
    """Workers the router lists as drained by the agent, or else by anyone else (`drained_by` absent: else)."""
    listed = {u: s.router or {} for u, s in snap.workers.items()}
    return [u for u, r in listed.items()
            if r.get("draining") is True and (r.get("drained_by") == AGENT) == by_agent]


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return 0
    return int(value)


class DecisionLog:
    """Appends one JSON object per line to `path` (None: kept in memory only)."""

    def __init__(self, path: str | None):
        self.path = pathlib.Path(path) if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps(record, default=str) + "\n")


class Agent:
    """One agent over one router: `sweep()` once, `run()` every `sweep_interval_s`; `dry_run` logs
    acting decisions as "dry-run" without acting; `wall_clock`: s since the epoch."""

    def __init__(self, router_url: str, cfg: AgentConfig, rule_cfg: RuleConfig | None = None,
                 ladder_cfg: LadderConfig | None = None,
                 wall_clock: Callable[[], float] = time.time):
        self.cfg, self.rule_cfg = cfg, rule_cfg or RuleConfig()
        self.router_url = router_url
        self.admin = AsyncRouterAdminClient(router_url, cfg.admin_api_key,
                                            timeout_s=max(cfg.request_timeout_s, 5.0))
        self.observer = Observer(self.admin, cfg.request_timeout_s, cfg.worker_api_key)
        self.history = History(cfg.history_sweeps)
        self.ladder = Ladder(ladder_cfg or LadderConfig())
        self.actions = Actions(self.admin, cfg.fleet_manifest if cfg.supervise else None,
                               cfg.kill_grace_s)
        self.log = DecisionLog(cfg.decision_log)
        self.recent: deque[dict] = deque(maxlen=200)
        self.wall_clock = wall_clock
        self.timeline = Timeline()
        self.last_sweep_at: float | None = None   # wall-clock s
        self.metrics = AgentMetrics(self.state)
        self.num_sweeps = 0
        self.last: FleetSnapshot | None = None
        self.findings: list[rules.Finding] = []
        self._router_note: str | None = None
        self._adopted = False   # the first sweep that reads the router adopts the agent's drains

    def state(self) -> dict:
        return {"workers": {u: t.state for u, t in self.ladder.tracks.items()},
                "panic": self.ladder.panic, "gpu_checks": bool(self.last and self.last.gpus)}

    async def run(self) -> None:
        while True:
            t0 = time.monotonic()
            try:
                await self.sweep()
            except Exception:  # one sweep's bug must not stop the agent
                logger.exception("sweep %d failed", self.num_sweeps)
            await asyncio.sleep(max(self.cfg.sweep_interval_s - (time.monotonic() - t0), 0.0))

    async def sweep(self) -> list[dict]:
        t0 = time.monotonic()
        self.num_sweeps += 1
        self.actions.reap()
        snap = await self.observer.collect(self.ladder.wants_probe(), self.cfg.probe_timeout_s,
                                           self.cfg.probe_max_tokens)
        self.last, self.last_sweep_at = snap, self.wall_clock()
        if snap.router_error:
            records = []
            if self._router_note != snap.router_error:
                records.append(self._record(Decision("none", None, "did nothing because the "
                                                     f"router cannot be read: {snap.router_error}")))
            self._router_note = snap.router_error
            return records
        self._router_note = None
        self.history.add(snap)
        hists = self.history.all()
        self.findings = rules.evaluate(hists, self.rule_cfg, snap.gpus)
        for f in self.findings:
            self.metrics.findings.labels(kind=f.kind).inc()
        adopted = [] if self._adopted else self.ladder.adopt(snap.t, _drained(snap, by_agent=True))
        self._adopted = True
        decisions = adopted + self.ladder.step(snap.t, self._view(snap, hists), self.findings)
        records = [await self._apply(d, snap) for d in decisions]
        self.timeline.record(self.last_sweep_at, hists, sum(d.acts for d in decisions))
        if not records and self.num_sweeps % self.cfg.heartbeat_sweeps == 1:
            records.append(self._record(Decision("none", None, self._quiet_reason(snap))))
        self.metrics.sweeps.inc()
        self.metrics.sweep_s.observe(time.monotonic() - t0)
        return records

    def _view(self, snap: FleetSnapshot, hists: dict) -> FleetView:
        probed = self.ladder.wants_probe()
        return FleetView(
            urls=tuple(snap.workers),
            responsive=frozenset(u for u in snap.workers if rules.answering(hists.get(u, []))),
            in_flight={u: _count((s.router or {}).get("in_flight"))
                       for u, s in snap.workers.items()},
            recovered=frozenset(u for u in probed if rules.probe_recovered(hists.get(u, []),
                                                                           self.rule_cfg)),
            supervised=self.actions.supervised(), policy=snap.policy,
            operator_drained=frozenset(_drained(snap, by_agent=False)))

    def _quiet_reason(self, snap: FleetSnapshot) -> str:
        if self.findings:
            return "did nothing new: " + "; ".join(f.text for f in self.findings)
        healthy = sum(s.health_ok for s in snap.workers.values())
        alive = sum(rules.answering(self.history.of(u)) for u in snap.workers)
        return (f"did nothing because no rule fired ({len(snap.workers)} workers, {healthy} "
                f"answering /health in time, {alive} alive)")

    async def _apply(self, d: Decision, snap: FleetSnapshot) -> dict:
        result = "-"
        if d.acts and self.cfg.dry_run:
            result = "dry-run"
        elif d.acts:
            try:
                answer = await self.actions.apply(d, self._engine_pid(d.worker))
                result = f"ok: {json.dumps(answer, default=str)[:200]}"
            except Exception as exc:
                logger.warning("%s %s failed: %s", d.action, d.worker, exc)
                result = f"failed: {type(exc).__name__}: {exc}"
                self.metrics.failed.labels(action=d.action).inc()
                self.ladder.undo(d)
        if d.action in ("restart", "undrain") and d.worker and not result.startswith("failed"):
            self.history.reset(d.worker)
        return self._record(d, result, snap)

    def _engine_pid(self, url: str | None) -> int | None:
        """The engine pid the worker last reported (a hung one does not answer now)."""
        for snap in reversed(self.history.of(url) if url else []):
            pid = (snap.info or {}).get("engine_pid")
            if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
                return pid
        return None

    def _record(self, d: Decision, result: str = "-", snap: FleetSnapshot | None = None) -> dict:
        now = datetime.datetime.fromtimestamp(self.wall_clock(), datetime.timezone.utc)
        record = {"time": now.isoformat(timespec="milliseconds"),
                  "sweep": self.num_sweeps, "dry_run": self.cfg.dry_run, "result": result,
                  **d.to_json()}
        if d.worker and snap and d.worker in snap.workers:
            s = snap.workers[d.worker]
            record["observed"] = {"health_ok": s.health_ok, "health_error": s.health_error,
                                  "router": s.router}
        self.metrics.decisions.labels(action=d.action).inc()
        self.log.write(record)
        self.recent.append(record)
        if d.action != "none":
            logger.info("%s %s: %s (%s)", d.action, d.worker or "fleet", d.reason, result)
        return record

    async def aclose(self) -> None:
        await self.observer.aclose()
        await self.admin.aclose()
