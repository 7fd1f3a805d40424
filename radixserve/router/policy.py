"""Routing policies: cache_aware, power_of_two, round_robin, random, session (SGLang router)."""
from __future__ import annotations

import bisect
import hashlib
import math
import random
from typing import NamedTuple

from radixserve.router.config import RouterConfig
from radixserve.router.prefix_tree import ApproxPrefixTree
from radixserve.router.worker import WorkerRegistry, WorkerState

REASONS = ("prefix_hit", "load_fallback", "imbalance", "round_robin", "random",
           "power_of_two", "session")
PARAMS = ("cache_threshold", "balance_abs_threshold", "balance_rel_threshold")
VIRTUAL_NODES = 160  # points per worker on the session hash ring (ketama's count)
# loads (requests) this close to the minimum tie (production-stack: "within +1 of the minimum")
LOAD_TIE = 0.5


class RouteKey(NamedTuple):
    """The prompt (token ids, or text without a tokenizer) and the session key, if any."""

    key: str | list[int]
    session: str | None = None


class Decision(NamedTuple):

    worker: WorkerState
    reason: str


class Policy:

    name = "base"

    def __init__(self, config: RouterConfig, registry: WorkerRegistry,
                 tree: ApproxPrefixTree, rng: random.Random | None = None) -> None:
        self.registry = registry
        self.tree = tree
        self.rng = rng or random.Random()
        self._params = {p: float(getattr(config, p)) for p in PARAMS}

    def select(self, request: RouteKey, candidates: list[WorkerState]) -> Decision:
        """Raises ValueError if `candidates` is empty."""
        if not candidates:
            raise ValueError("no candidate workers")
        return self._select(request, candidates)

    def _select(self, request: RouteKey, candidates: list[WorkerState]) -> Decision:
        raise NotImplementedError

    def params(self) -> dict[str, float]:
        return dict(self._params)

    def set_params(self, **kw: float) -> dict[str, float]:
        """Set some PARAMS, all or nothing; balance_abs_threshold (requests) is also the stale
        penalty. Returns the params in force. Raises ValueError on an unknown name or value."""
        new = dict(self._params)
        for name, value in kw.items():
            if name not in PARAMS:
                raise ValueError(f"unknown policy param {name!r}; known: {PARAMS}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            new[name] = float(value)
        if not 0.0 <= new["cache_threshold"] <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")
        if new["balance_abs_threshold"] < 0:
            raise ValueError("balance_abs_threshold must be >= 0")
        if new["balance_rel_threshold"] < 1.0:
            raise ValueError("balance_rel_threshold must be >= 1")
        self._params = new
        self.registry.set_stale_penalty(new["balance_abs_threshold"])
        return self.params()

    def loads(self, candidates: list[WorkerState]) -> dict[str, float]:
        now = self.registry.clock()
        return {w.url: w.load(now) / w.weight for w in candidates}

    def least_loaded(self, candidates: list[WorkerState], loads: dict[str, float]) -> WorkerState:
        low = min(loads[w.url] for w in candidates)
        return self.rng.choice([w for w in candidates if loads[w.url] <= low + LOAD_TIE])


class CacheAwarePolicy(Policy):
    """Prefix affinity against predicted load (SGLang router cache_aware; SMG's dead-band).

    match / len(key) > cache_threshold: the longest match, else the least loaded. If that load
    exceeds both mean + balance_abs_threshold and balance_rel_threshold x mean: the longest
    match among loads <= min + balance_abs_threshold ("imbalance")."""

    name = "cache_aware"

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.registry.on_remove.append(self.tree.remove_tenant)

    def _select(self, request: RouteKey, candidates: list[WorkerState]) -> Decision:
        key, p = request.key, self._params
        loads = self.loads(candidates)
        matched = self.tree.match(key).tenants if len(key) else {}

        def affinity(w: WorkerState) -> tuple[int, float]:
            return matched.get(w.url, 0), -loads[w.url]

        best = max(candidates, key=affinity)
        if len(key) and matched.get(best.url, 0) / len(key) > p["cache_threshold"]:
            chosen, reason = best, "prefix_hit"
        else:
            chosen, reason = self.least_loaded(candidates, loads), "load_fallback"
        mean = sum(loads.values()) / len(loads)
        load = loads[chosen.url]
        if load > mean + p["balance_abs_threshold"] and load > p["balance_rel_threshold"] * mean:
            ceiling = min(loads.values()) + p["balance_abs_threshold"]
            near = [w for w in candidates if loads[w.url] <= ceiling]
            top = max(affinity(w) for w in near)
            chosen = self.rng.choice([w for w in near if affinity(w) == top])
            reason = "imbalance"
        if len(key):
            self.tree.insert(key, chosen.url)
        chosen.note_routed(len(key), matched.get(chosen.url, 0))
        return Decision(chosen, reason)


class PowerOfTwoPolicy(Policy):
    """Two distinct random candidates; the lower load wins (SGLang power_of_two)."""

    name = "power_of_two"

    def _select(self, request: RouteKey, candidates: list[WorkerState]) -> Decision:
        if len(candidates) == 1:
            return Decision(candidates[0], self.name)
        a, b = self.rng.sample(candidates, 2)
        loads = self.loads([a, b])
        return Decision(b if loads[b.url] < loads[a.url] else a, self.name)


class RoundRobinPolicy(Policy):
    """Candidates in turn (SGLang round_robin)."""

    name = "round_robin"

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._next = 0

    def _select(self, request: RouteKey, candidates: list[WorkerState]) -> Decision:
        worker = candidates[self._next % len(candidates)]
        self._next += 1
        return Decision(worker, self.name)


class RandomPolicy(Policy):

    name = "random"

    def _select(self, request: RouteKey, candidates: list[WorkerState]) -> Decision:
        return Decision(self.rng.choice(candidates), self.name)


class SessionPolicy(Policy):
    """Consistent hashing of the session key (Karger et al. 1997; SGLang consistent_hashing); none: the least loaded."""

    name = "session"

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._ring_urls: tuple[str, ...] = ()
        self._ring: list[tuple[int, str]] = []

    def _select(self, request: RouteKey, candidates: list[WorkerState]) -> Decision:
        if request.session is None:
            return Decision(self.least_loaded(candidates, self.loads(candidates)),
                            "load_fallback")
        urls = tuple(sorted(w.url for w in candidates))
        if urls != self._ring_urls:
            self._ring_urls = urls
            self._ring = sorted((_hash(f"{url}#{i}"), url)
                                for url in urls for i in range(VIRTUAL_NODES))
        at = bisect.bisect(self._ring, (_hash(request.session), "")) % len(self._ring)
        url = self._ring[at][1]
        return Decision(next(w for w in candidates if w.url == url), self.name)


def _hash(text: str) -> int:
    """Stable 64-bit hash (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


_POLICIES = {cls.name: cls for cls in (CacheAwarePolicy, PowerOfTwoPolicy, RoundRobinPolicy,
                                       RandomPolicy, SessionPolicy)}


def make_policy(config: RouterConfig, registry: WorkerRegistry, tree: ApproxPrefixTree,
                rng: random.Random | None = None) -> Policy:
    """The policy named by config.policy. Raises ValueError on an unknown name."""
    if config.policy not in _POLICIES:
        raise ValueError(f"unknown policy {config.policy!r}; known: {tuple(_POLICIES)}")
    return _POLICIES[config.policy](config, registry, tree, rng)
