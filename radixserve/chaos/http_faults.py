"""The worker's /admin/fault (--enable-fault-injection); the kinds: docs/anomaly_guard.md, docs/hicache.md, docs/disaggregation.md."""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from radixserve.errors import InjectedFault, InvalidRequest

logger = logging.getLogger(__name__)


class EngineCalls(Protocol):
    """The HTTP process's handle on the engine (server/engine_client.py EngineClient)."""

    async def call(self, method: str, timeout_s: float = 60.0, args: dict[str, Any] | None = None) -> Any: ...


class TextUpdate(Protocol):
    """What the corrupter rewrites: a choice update's new text (server/tracker.py ChoiceUpdate)."""

    text: str

FAULT_PATH_PREFIX = "/admin/fault"
PD_POINTS = ("pd.bootstrap", "pd.prefill.start", "pd.transfer.write", "pd.transfer.done",
             "pd.decode.prealloc")
LEAK_TICK_S = 0.25
KIND_PARAMS = {"step_latency": ("latency_ms", "jitter_ms"), "first_token_latency": ("latency_ms",),
               "fail": ("fraction",), "hang": (), "leak_memory": ("mb_per_s", "max_mb"),
               "corrupt": ("mode", "fraction"), "sampler.force_tokens": ("token_ids", "count"),
               "kv_corrupt": ("mode", "fraction", "after_tokens", "count"),
               "hicache.h2d.layer": ("latency_ms", "jitter_ms", "fail_fraction", "skip_wait"),
               "hicache.d2h": ("latency_ms",), "hicache.host_alloc": ("fraction",),
               "hicache.l3.get": ("mode", "every", "stall_ms"),
               **{point: ("action", "delay_ms", "delay_max_ms", "probability", "count")
                  for point in PD_POINTS}}
ENGINE_FAULTS = ("step_latency", "sampler.force_tokens", "kv_corrupt", "hicache.h2d.layer",
                 "hicache.d2h", "hicache.host_alloc", "hicache.l3.get", *PD_POINTS)
TEXT_CORRUPT_MODES = ("garble", "repeat", "noise")
MAX_FORCED_TOKENS = 1 << 16
ForcedId = Annotated[int, Field(ge=0, le=2**31 - 1)]   # the engine checks it against the vocabulary


class FaultSpec(BaseModel):
    """Body of POST /admin/fault; a parameter the kind does not take is a 400, as is any number
    that is not a finite JSON number (an Infinity would break every reply listing the fault)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    kind: Literal["step_latency", "first_token_latency", "fail", "hang", "leak_memory", "corrupt",
                  "sampler.force_tokens", "kv_corrupt", "hicache.h2d.layer", "hicache.d2h",
                  "hicache.host_alloc", "hicache.l3.get", "pd.bootstrap", "pd.prefill.start",
                  "pd.transfer.write", "pd.transfer.done", "pd.decode.prealloc"]
    duration_s: float | None = Field(None, gt=0)
    latency_ms: float | None = Field(None, ge=0, le=600_000)
    jitter_ms: float = Field(0.0, ge=0, le=600_000)
    fraction: float = Field(1.0, ge=0, le=1)
    fail_fraction: float = Field(0.0, ge=0, le=1)
    skip_wait: Literal["none", "side", "all"] = "none"
    mb_per_s: float | None = Field(None, gt=0, le=4096)
    max_mb: float = Field(4096, gt=0, le=65536)
    mode: Literal["garble", "repeat", "noise", "swap", "fail", "fail_chunk", "short", "stall"] | None = None
    every: int = Field(1, ge=1, le=1 << 20)
    stall_ms: float = Field(0.0, ge=0, le=600_000)
    after_tokens: int = Field(16, ge=0, le=1 << 20)
    token_ids: list[ForcedId] | None = Field(None, min_length=1, max_length=MAX_FORCED_TOKENS)
    count: int = Field(1, ge=1, le=1 << 31)
    action: Literal["delay", "fail", "hang", "duplicate", "late"] | None = None
    delay_ms: float = Field(0.0, ge=0, le=600_000)
    delay_max_ms: float | None = Field(None, ge=0, le=600_000)
    probability: float = Field(1.0, ge=0, le=1)

    def params(self) -> dict[str, Any]:
        allowed = KIND_PARAMS[self.kind]
        unexpected = sorted(set(self.model_fields_set) - set(allowed) - {"kind", "duration_s"})
        if unexpected:
            name = unexpected[0]
            raise InvalidRequest(f"fault {self.kind!r} takes no {name!r}", param=name)
        if self.kind == "corrupt" and self.mode not in (None, *TEXT_CORRUPT_MODES):
            raise InvalidRequest(f"fault 'corrupt' takes mode {TEXT_CORRUPT_MODES}", param="mode")
        if self.kind == "kv_corrupt" and self.fraction == 0:
            raise InvalidRequest("fault 'kv_corrupt' needs fraction > 0", param="fraction")
        params = {name: getattr(self, name) for name in allowed}
        if self.kind in PD_POINTS:   # count absent: unlimited
            if "count" not in self.model_fields_set:
                params["count"] = None
            if self.action is None:
                raise InvalidRequest(f"fault {self.kind!r} needs 'action'", param="action")
            return params
        missing = [name for name, value in params.items() if value is None]
        if missing:
            raise InvalidRequest(f"fault {self.kind!r} needs {missing[0]!r}", param=missing[0])
        return params


@dataclass
class Fault:
    """One active fault; `started_s` and `ends_s` are time.monotonic() values."""

    kind: str
    params: dict[str, Any]
    duration_s: float | None
    started_s: float = field(default_factory=time.monotonic)

    @property
    def ends_s(self) -> float | None:
        return None if self.duration_s is None else self.started_s + self.duration_s

    def is_active(self, now_s: float) -> bool:
        return self.ends_s is None or now_s < self.ends_s

    def to_json(self, now_s: float) -> dict[str, Any]:
        ends = self.ends_s
        return {"kind": self.kind, **self.params, "duration_s": self.duration_s,
                "elapsed_s": round(now_s - self.started_s, 3),
                "remaining_s": None if ends is None else round(max(ends - now_s, 0.0), 3)}


class FaultInjector:
    def __init__(self, client: EngineCalls, rng: random.Random | None = None):
        self.client = client
        self.rng = rng or random.Random()
        self._faults: dict[str, Fault] = {}
        self._hang_over = asyncio.Event()
        self._hang_over.set()
        self._leak_task: asyncio.Task | None = None
        self._leaked: list[bytes] = []

    async def inject(self, spec: FaultSpec) -> Fault:
        """Start a fault (replacing its kind's); InvalidRequest: bad params; EngineDead: ENGINE_FAULTS, no engine."""
        fault = Fault(spec.kind, spec.params(), spec.duration_s)
        await self.clear(fault.kind)
        if fault.kind in ENGINE_FAULTS:
            args = {"kind": fault.kind, **fault.params, "duration_s": fault.duration_s}
            if fault.kind == "kv_corrupt":
                args["seed"] = self.rng.getrandbits(31)
            await self.client.call("fault", args=args)
        elif fault.kind == "hang":
            self._hang_over = asyncio.Event()
        elif fault.kind == "leak_memory":
            self._leak_task = asyncio.create_task(self._leak(fault), name="fault-leak-memory")
        self._faults[fault.kind] = fault
        logger.warning("fault injected: %s", fault.to_json(time.monotonic()))
        return fault

    async def clear(self, kind: str | None = None) -> list[str]:
        """End one kind, or all; returns the kinds ended (expired ones included)."""
        kinds = [k for k in self._faults if kind is None or k == kind]
        for k in kinds:
            del self._faults[k]
            if k in ENGINE_FAULTS:
                try:
                    await self.client.call("fault", args={"kind": k, "clear": True})
                except Exception:
                    logger.warning("could not disarm %s in the engine", k, exc_info=True)
            elif k == "hang":
                self._hang_over.set()
            elif k == "leak_memory":
                self._stop_leak()
        if kinds:
            logger.warning("faults cleared: %s", ", ".join(kinds))
        return kinds

    def active(self) -> list[Fault]:
        now = time.monotonic()
        return [f for f in self._faults.values() if f.is_active(now)]

    def get(self, kind: str) -> Fault | None:
        fault = self._faults.get(kind)
        return fault if fault is not None and fault.is_active(time.monotonic()) else None

    async def wait_while_hung(self) -> None:
        while (fault := self.get("hang")) is not None:   # again: a new hang may replace it
            ends = fault.ends_s
            timeout = None if ends is None else max(ends - time.monotonic(), 0.0)
            try:
                await asyncio.wait_for(self._hang_over.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    async def on_accepted(self) -> None:
        """Once the engine holds a request: InjectedFault for the "fail" share, else first_token_latency's sleep."""
        fail = self.get("fail")
        if fail is not None and self.rng.random() < fail.params["fraction"]:
            raise InjectedFault("injected fault: this request failed on purpose (fault 'fail')")
        slow = self.get("first_token_latency")
        if slow is not None:
            await asyncio.sleep(slow.params["latency_ms"] / 1000)

    def corrupter(self) -> Corrupter | None:
        fault = self.get("corrupt")
        if fault is None or self.rng.random() >= fault.params["fraction"]:
            return None
        return Corrupter(fault.params["mode"], random.Random(self.rng.random()))

    async def _leak(self, fault: Fault) -> None:
        """Hold (and touch) mb_per_s MiB more every second, up to max_mb."""
        chunk = int(fault.params["mb_per_s"] * LEAK_TICK_S * (1 << 20))
        limit = int(fault.params["max_mb"] * (1 << 20))
        while fault.is_active(time.monotonic()):
            if chunk * (len(self._leaked) + 1) <= limit:
                self._leaked.append(b"\xa5" * chunk)
            await asyncio.sleep(LEAK_TICK_S)
        self._leaked.clear()

    def _stop_leak(self) -> None:
        if self._leak_task is not None:
            self._leak_task.cancel()
            self._leak_task = None
        self._leaked.clear()


class HangMiddleware:
    """While a hang fault is in force, HTTP requests to any path but /admin/fault* wait."""

    def __init__(self, app: Any, faults: FaultInjector):
        self.app = app
        self.faults = faults

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not scope["path"].startswith(FAULT_PATH_PREFIX):
            await self.faults.wait_while_hung()
        await self.app(scope, receive, send)


NOISE_CHARS = "\ue000\ue0a7\uf8ff\x01\x07\x1b\x7f\u0378\u0380\u2801\u28ff\u2400\u241b\U000f0001"


class Corrupter:
    """Alters one request's text deltas per choice (modes: docs/anomaly_guard.md)."""

    def __init__(self, mode: str, rng: random.Random):
        self.mode = mode
        self.rng = rng
        self._seen: dict[int, str] = {}   # choice index -> first delta (repeat mode)

    def feed(self, index: int, update: TextUpdate) -> None:
        update.text = self.apply(index, update.text)

    def apply(self, index: int, text: str) -> str:
        if not text:
            return text
        if self.mode == "garble":
            data = bytearray(text.encode())
            for i in range(len(data)):
                if self.rng.random() < 0.25:
                    data[i] ^= 0x80 | self.rng.randrange(1, 0x80)
            return data.decode(errors="replace")
        if self.mode == "noise":
            return "".join(c + self.rng.choice(NOISE_CHARS) if self.rng.random() < 0.125 else c
                           for c in text)
        seen = self._seen.get(index)
        if seen is None:
            self._seen[index] = text
            return text
        return self._ngram(seen)

    @staticmethod
    def _ngram(seen: str) -> str:
        """The first two words (" the" if none, <= 24 characters), repeated to >= 12 characters."""
        words = seen.split()
        gram = (" " + " ".join(words[:2]) if words else " the")[:24]
        return gram * -(-12 // len(gram))
