"""Per-worker confirmation ladder (observe -> suspect -> draining -> restarted/isolated -> reintegrating) and routing-policy steps.

No I/O: findings in, decisions out. Envoy outlier detection: confirmation over sweeps, ejection time
base x n (capped), a capped share of the fleet out (at least one), panic (alert only) below a share.

    observe --finding--> suspect --held confirm_sweeps--> (gates) --+--> draining (slow) --probes ok--+
       ^  <--quiet clear_sweeps--'                                  +--> draining (hung) --> restarted --+
       |                                                            +--> isolated (errors) --time out--+
       +---- quiet reintegrate_sweeps ---- reintegrating <---- undrain <----------------------------+"""
from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.agent.config import LadderConfig
from radixserve.agent.rules import Finding

# finding kind -> class of fault; classes in increasing severity
KIND_CLASS = {"hit_rate_collapsed": "watch", "ttft_outlier": "slow", "itl_outlier": "slow",
              "queue_building": "slow", "kv_pressure": "slow", "error_rate": "faulty",
              "anomaly_rate": "faulty", "memory_growth": "leak", "unresponsive": "hung"}
SEVERITY = ("watch", "slow", "faulty", "leak", "hung")
OUT_STATES = ("draining", "restarted", "isolated")
# Every Decision.action (metrics start each at 0), and those that change the fleet.
ACTIONS = ("none", "suspect", "clear", "drain", "isolate", "restart", "undrain", "alert",
           "set_policy_params", "adopt")
ACTING = ("drain", "isolate", "restart", "undrain", "set_policy_params")


@dataclass(frozen=True)
class Decision:
    """`action` in ACTIONS; `worker` None for fleet-level ones; `reason` also when nothing was done."""

    action: str
    worker: str | None
    reason: str
    state_from: str | None = None
    state_to: str | None = None
    findings: tuple[Finding, ...] = ()
    params: dict = field(default_factory=dict)

    @property
    def acts(self) -> bool:
        return self.action in ACTING

    def to_json(self) -> dict:
        return {"action": self.action, "worker": self.worker, "reason": self.reason,
                "state_from": self.state_from, "state_to": self.state_to,
                "findings": [f.to_json() for f in self.findings], "params": self.params}


@dataclass(frozen=True)
class FleetView:
    """One sweep's view; `operator_drained`: drained at the router by someone else (never acted on)."""

    urls: tuple[str, ...]
    responsive: frozenset[str]
    in_flight: dict[str, int] = field(default_factory=dict)
    recovered: frozenset[str] = frozenset()
    supervised: frozenset[str] = frozenset()
    policy: dict | None = None
    operator_drained: frozenset[str] = frozenset()


@dataclass(slots=True)
class Track:
    """Ladder state of one worker; times are monotonic s."""

    url: str
    state: str = "observe"
    fault: str | None = None
    held: int = 0                     # consecutive sweeps with a finding
    quiet: int = 0                    # consecutive sweeps without one
    ejections: int = 0                # decays by one per max_ejection_s quiet
    since: float = 0.0
    out_until: float = 0.0
    forgive_at: float = 0.0


class Ladder:
    """`step(now, view, findings) -> decisions`; `undo(decision)` when applying one failed."""

    def __init__(self, cfg: LadderConfig):
        self.cfg = cfg
        self.tracks: dict[str, Track] = {}
        self.last_policy_t = float("-inf")
        self.panic = False
        self._noted: dict[str, str] = {}

    def ejection_s(self, n: int) -> float:
        """Envoy: base_ejection_time x times ejected, capped (s); a restarted repeat offender waits n - 1."""
        return min(self.cfg.base_ejection_s * max(n, 1), self.cfg.max_ejection_s)

    def step(self, now: float, view: FleetView, findings: list[Finding]) -> list[Decision]:
        by_url: dict[str, list[Finding]] = {u: [] for u in view.urls}
        for f in findings:
            if f.url in by_url:
                by_url[f.url].append(f)
        self.tracks = {u: self.tracks.get(u) or Track(u, since=now) for u in view.urls}
        out = sum(t.state in OUT_STATES for t in self.tracks.values())
        gate = _Gate(allowed=max(1, int(self.cfg.max_ejection_share * len(view.urls))), out=out,
                     actions_left=self.cfg.max_actions_per_sweep,
                     panic=len(view.responsive) < self.cfg.panic_share * len(view.urls))
        decisions = []
        if gate.panic != self.panic:
            self.panic = gate.panic
            decisions.append(Decision("alert" if gate.panic else "none", None, (
                f"panic: {len(view.responsive)} of {len(view.urls)} workers answer /health; "
                "new actions stopped") if gate.panic else "panic over: acting again"))
        order = sorted(self.tracks.values(), key=lambda t: -_severity(by_url[t.url]))
        for track in order:
            decisions += self._step_worker(track, by_url[track.url], now, view, gate)
        fleet = [f for f in findings if f.url is None]
        return decisions + self._fleet(fleet, now, view)

    def adopt(self, now: float, urls: list[str]) -> list[Decision]:
        """Before the first `step`: isolate the workers an earlier agent drained, as if ejected once (counted out)."""
        hold = self.ejection_s(1)
        for url in urls:
            self.tracks[url] = Track(url, "isolated", ejections=1, since=now, out_until=now + hold,
                                     forgive_at=now + self.cfg.max_ejection_s)
        return [Decision("adopt", url, "drained at the router by an earlier agent: isolated for "
                         f"{hold:.0f} s, then back once /health answers", "observe", "isolated")
                for url in urls]

    def wants_probe(self) -> set[str]:
        """Drained slow workers, which the agent probes each sweep."""
        return {t.url for t in self.tracks.values() if t.state == "draining" and t.fault == "slow"}

    def undo(self, decision: Decision) -> None:
        """Put a worker back in the state it had before `decision` (its action failed)."""
        track = self.tracks.get(decision.worker or "")
        if track is not None and decision.state_from is not None:
            track.state = decision.state_from
            track.held = self.cfg.confirm_sweeps - 1  # still confirmed: retried next sweep
            if decision.action in ("drain", "isolate"):
                track.ejections = max(track.ejections - 1, 0)

    def _step_worker(self, t: Track, found: list[Finding], now: float, view: FleetView,
                     gate: _Gate) -> list[Decision]:
        fault = _worst(found)
        if t.state in OUT_STATES and t.url in view.operator_drained:
            return [self._move(t, "none", "observe", now, found, "the operator drained it at the "
                               "router too: left to the operator (no undrain, no restart)")]
        if t.state in ("observe", "reintegrating", "suspect"):
            return self._watch(t, found, fault, now, view, gate)
        if t.state == "draining":
            if fault == "hung" and t.fault == "slow":
                t.fault, t.since = "hung", now
                if t.url not in view.supervised:
                    t.out_until = now + self.ejection_s(t.ejections)
                    return [self._move(t, "isolate", "isolated", now, found, "drained slow "
                                       "worker stopped answering: isolate (not supervising)")]
            if t.fault == "slow":
                if t.url in view.recovered:
                    return [self._move(t, "undrain", "reintegrating", now, found,
                                       "recovery probes passed: back in rotation")]
                return self._note(t.url, Decision("none", t.url, "draining (slow): did nothing "
                                                  "because recovery probes have not passed yet",
                                                  t.state, t.state, tuple(found)))
            in_flight = view.in_flight.get(t.url, 0)
            if in_flight == 0 or now - t.since >= self.cfg.drain_timeout_s:
                hold = self.ejection_s(t.ejections - 1) if t.ejections > 1 else 0.0
                t.out_until = now + hold
                back = (f"kept out {hold:.0f} s more (repeat offender)" if hold else
                        "back in rotation once /health answers")
                return [self._move(t, "restart", "restarted", now, found,
                                   f"drained ({in_flight} still in flight): restarting, {back}")]
            return self._note(t.url, Decision("none", t.url, f"draining before restart: did nothing "
                                              f"because {in_flight} requests are in flight",
                                              t.state, t.state, tuple(found)))
        return self._out(t, found, now, view)

    def _watch(self, t: Track, found: list[Finding], fault: str | None, now: float,
               view: FleetView, gate: _Gate) -> list[Decision]:
        if fault is None or fault == "watch":
            t.held, t.quiet = 0, t.quiet + 1
            if t.state == "suspect" and t.quiet >= self.cfg.clear_sweeps:
                return [self._move(t, "clear", "observe", now, found, "finding cleared")]
            if t.state == "reintegrating" and t.quiet >= self.cfg.reintegrate_sweeps:
                return [self._move(t, "none", "observe", now, found, "reintegrated: quiet since return")]
            if t.state == "observe" and t.ejections and now >= t.forgive_at:
                t.ejections, t.forgive_at = t.ejections - 1, now + self.cfg.max_ejection_s
            if fault == "watch":
                return self._note(t.url, Decision("none", t.url, "did nothing because "
                                                  + "; ".join(f.text for f in found)
                                                  + " is watched, not acted on", t.state,
                                                  t.state, tuple(found)))
            return []
        t.quiet, t.held = 0, t.held + 1
        if t.state != "suspect":
            return [self._move(t, "suspect", "suspect", now, found,
                               f"{fault}: suspect, held 1 of {self.cfg.confirm_sweeps} sweeps")
                    ] + (self._act(t, fault, found, now, view, gate)
                         if self.cfg.confirm_sweeps <= 1 else [])
        if t.held < self.cfg.confirm_sweeps:
            return self._note(t.url, Decision("none", t.url, f"{fault}: did nothing because held "
                                              f"{t.held} of {self.cfg.confirm_sweeps} sweeps",
                                              t.state, t.state, tuple(found)))
        return self._act(t, fault, found, now, view, gate)

    def _act(self, t: Track, fault: str, found: list[Finding], now: float, view: FleetView,
             gate: _Gate) -> list[Decision]:
        why = None
        if t.url in view.operator_drained:
            why = "the operator drained it at the router (the agent leaves that drain alone)"
        elif gate.panic:
            why = "panic (too few workers answer /health)"
        elif gate.out >= gate.allowed:
            why = (f"max share out of rotation reached ({gate.out} of {len(view.urls)} out, "
                   f"at most {gate.allowed})")
        elif gate.actions_left <= 0:
            why = "one new action per sweep; it waits for the next"
        elif fault == "leak" and t.url not in view.supervised:
            why = "not supervising this worker, so it cannot be restarted"
        if why:
            kind = "alert" if gate.panic or fault == "leak" else "none"
            return self._note(t.url, Decision(kind, t.url,
                                              f"{fault} confirmed: did nothing because {why}",
                                              t.state, t.state, tuple(found)))
        gate.out, gate.actions_left = gate.out + 1, gate.actions_left - 1
        t.fault, t.ejections = fault, t.ejections + 1
        t.forgive_at = now + self.cfg.max_ejection_s
        if fault in ("hung", "leak") and t.url in view.supervised:
            return [self._move(t, "drain", "draining", now, found, f"{fault} confirmed: drain, "
                               "then restart")]
        if fault == "slow":
            return [self._move(t, "drain", "draining", now, found, "slow confirmed: drain (not "
                               "restart) until recovery probes pass")]
        t.out_until = now + self.ejection_s(t.ejections)
        return [self._move(t, "isolate", "isolated", now, found, f"{fault} confirmed: isolate for "
                           f"{self.ejection_s(t.ejections):.0f} s (ejection {t.ejections})")]

    def _out(self, t: Track, found: list[Finding], now: float, view: FleetView) -> list[Decision]:
        """restarted / isolated: return once the ejection time is over and /health answers."""
        healthy = t.url in view.responsive
        if now >= t.out_until and healthy:
            return [self._move(t, "undrain", "reintegrating", now, found,
                               f"{t.state} for {now - t.since:.0f} s and /health answers: return")]
        if t.state == "restarted" and not healthy and now - t.since >= self.cfg.restart_timeout_s:
            return [Decision("alert", t.url, "restarted worker not healthy in time: restart again",
                             t.state, t.state, tuple(found)),
                    self._move(t, "restart", "restarted", now, found, "restart again")]
        if t.state == "isolated" and not healthy and now >= t.out_until:
            if t.fault == "hung" and t.url in view.supervised:
                return [self._move(t, "restart", "restarted", now, found, "still not answering "
                                   "after its ejection: restart")]
            t.out_until = now + self.ejection_s(t.ejections)
        return self._note(t.url, Decision("none", t.url, f"{t.state}: did nothing because "
                                          + (f"its {self.ejection_s(t.ejections):.0f} s ejection "
                                             "is not over" if now < t.out_until
                                             else "/health does not answer yet"),
                                          t.state, t.state, tuple(found)))

    def _move(self, t: Track, action: str, state: str, now: float, found: list[Finding],
              reason: str) -> Decision:
        d = Decision(action, t.url, reason, t.state, state, tuple(found))
        if state != t.state or action in ("restart", "undrain"):
            t.since = now
        if state not in (t.state, "suspect"):  # suspect keeps _watch's count
            t.held = t.quiet = 0
        t.state = state
        self._noted.pop(t.url, None)
        return d

    def _note(self, key: str, d: Decision) -> list[Decision]:
        """A 'did nothing' decision is logged when its reason changes, not every sweep."""
        if self._noted.get(key) == d.reason:
            return []
        self._noted[key] = d.reason
        return [d]

    def _fleet(self, fleet: list[Finding], now: float, view: FleetView) -> list[Decision]:
        decisions = []
        for f in fleet:
            if f.kind == "gpu_unhealthy":
                decisions += self._note(f.text, Decision("alert", None, f.text, findings=(f,)))
        spread = [f for f in fleet if f.kind == "fleet_ttft_spread"]
        collapsed = [f for f in fleet if f.kind == "fleet_hit_rate_collapsed"]
        found = spread or collapsed
        if not found or not view.policy or "cache_threshold" not in view.policy:
            return decisions
        if view.policy.get("policy", "cache_aware") != "cache_aware":
            return decisions + self._note("policy", Decision(
                "none", None, f"did nothing because the router's policy is "
                f"{view.policy['policy']}, not cache_aware", findings=tuple(found)))
        current = float(view.policy["cache_threshold"])
        step = self.cfg.cache_threshold_step
        target = (min(current + step, self.cfg.cache_threshold_max) if spread
                  else max(current - step, self.cfg.cache_threshold_min))
        what = "lower prefix affinity" if spread else "raise prefix affinity"
        if now - self.last_policy_t < self.cfg.policy_cooldown_s:
            why = "the policy cooldown is running"
        elif abs(target - current) < 1e-9:
            why = f"cache_threshold is already at its limit ({current:.2f})"
        else:
            self.last_policy_t = now
            return decisions + [Decision("set_policy_params", None, f"{what}: cache_threshold "
                                         f"{current:.2f} -> {target:.2f}", findings=tuple(found),
                                         params={"cache_threshold": round(target, 4)})]
        return decisions + self._note("policy", Decision("none", None, f"{what}: did nothing "
                                                         f"because {why}", findings=tuple(found)))


@dataclass(slots=True)
class _Gate:
    """Per-sweep limits shared by all workers."""

    allowed: int
    out: int
    actions_left: int
    panic: bool


def _worst(found: list[Finding]) -> str | None:
    classes = [KIND_CLASS[f.kind] for f in found if f.kind in KIND_CLASS]
    return max(classes, key=SEVERITY.index) if classes else None


def _severity(found: list[Finding]) -> int:
    fault = _worst(found)
    return SEVERITY.index(fault) if fault else -1
