"""PDWorker: drives the Engine of a prefill or decode worker (--disaggregation-mode prefill|decode) together with one side of the KV handoff."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from radixserve.disagg.api import FaultPoints, Fired
from radixserve.disagg.decode_side import DecodeSide
from radixserve.disagg.prefill_side import PrefillSide
from radixserve.disagg.protocol import KVLayout, PDTarget
from radixserve.disagg.stats import PDStats
from radixserve.disagg.transport import TcpDecodeEndpoint, TcpPrefillEndpoint
from radixserve.engine.engine import Engine
from radixserve.engine.hooks import EngineHooks
from radixserve.engine.request import Request
from radixserve.engine.runner_api import Runner
from radixserve.engine_config import EngineConfig
from radixserve.errors import InvalidRequest
from radixserve.outputs import EngineOutput, TokenLogprob
from radixserve.sampling_params import SamplingParams

IDLE_WAIT_MS = 5    # with nothing to compute, wait this long for a PD message
ERROR_CODE = "kv_transfer_failed"   # EngineOutput.error_code of PD failures (HTTP 500)


class PDWorker:
    """Drives an Engine and its PD side; single-threaded (step, add_request, abort and has_unfinished run on the engine
    thread and do the PD I/O). The runner also offers kv_layout() -> dict, export_kv(page_ids) -> bytes and
    import_kv(page_ids, data, foreign). `endpoint`: transport.py's (default: TCP). `clock`: seconds, monotonic."""

    def __init__(self, config: EngineConfig, runner: Runner,
                 extra_eos_token_ids: frozenset[int] = frozenset(), hooks: Sequence[EngineHooks] = (),
                 endpoint=None, clock=time.monotonic):
        self.mode = config.disaggregation_mode
        assert self.mode in ("prefill", "decode"), f"PDWorker needs a PD mode, got {self.mode!r}"
        self.engine = Engine(config, runner, extra_eos_token_ids, [_SideHooks(self), *hooks])
        self.runner = runner
        self.clock = clock
        self.faults: FaultPoints | None = None
        self.pd_stats = PDStats()
        self._outbox: list[EngineOutput] = []
        layout = KVLayout(**runner.kv_layout())
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        if self.mode == "prefill":
            endpoint = endpoint or TcpPrefillEndpoint(config.disaggregation_bootstrap_host,
                                                      config.disaggregation_bootstrap_port)
            self.prefill = PrefillSide(self, endpoint, layout)
        else:
            self.decode = DecodeSide(self, endpoint or TcpDecodeEndpoint(), layout)
        self.endpoint = endpoint if endpoint is not None else self.decode.endpoint

    @property
    def side(self) -> PrefillSide | DecodeSide:
        return self.prefill or self.decode

    @property
    def bootstrap_address(self) -> str | None:
        return self.prefill.endpoint.address if self.prefill is not None else None

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    pd: PDTarget | None = None) -> None:
        """Engine.add_request with a required PD target (InvalidRequest without one)."""
        if pd is None:
            raise InvalidRequest(
                f"this worker runs with --disaggregation-mode {self.mode}: a request needs "
                "bootstrap_host, bootstrap_port and bootstrap_room (send it through "
                "`radixserve route --prefill ... --decode ...`)", param="bootstrap_room")
        self.engine.add_request(request_id, prompt_ids, params)
        try:
            self.side.add(self.engine.requests[request_id], pd)
        except Exception:
            self.engine.withdraw(request_id)
            raise

    def abort(self, request_id: str, reason: str = "abort") -> EngineOutput | None:
        if self.side.abort(request_id):
            return self._outbox.pop() if self._outbox else None
        return self.engine.abort(request_id, reason)

    def end_request(self, req: Request, error: str | None) -> None:
        """Engine.abort in any queue or PD state; the final output (next step()) carries `error` with ERROR_CODE."""
        out = self.engine.abort(req.request_id)
        if out is not None:
            if error is not None:
                out = dataclasses.replace(out, error=error, error_code=ERROR_CODE)
            self._outbox.append(out)

    def land(self, req: Request, token: TokenLogprob | None) -> None:
        if token is None:
            self._outbox.append(self.engine.finish(req, "length"))
        else:
            self._outbox.append(self.engine.emit(req, [token.token_id], [token]))

    def step(self) -> list[EngineOutput]:
        if self.prefill is not None:
            for peer, msg in self.endpoint.recv():
                self.prefill.handle(peer, msg)
            self.prefill.poll()
        else:
            for msg in self.endpoint.recv():
                self.decode.handle(msg)
            self.decode.poll()
        outs = self.engine.step()
        if self.prefill is not None:
            self.prefill.after_step()
        outs = self._outbox + outs
        self._outbox = []
        if not outs and not self.engine.has_unfinished():
            self.endpoint.wait(IDLE_WAIT_MS)
        return outs

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished() or bool(self._outbox) or self.side.is_busy() \
            or self.endpoint.wait(0)

    def io_sockets(self) -> list:
        """Sockets the engine loop should wake on (the prefill's bootstrap service)."""
        return [self.prefill.endpoint.socket] if self.prefill is not None else []

    def close(self) -> None:
        self.endpoint.close()

    def fire(self, point: str) -> Fired | None:
        return self.faults.fire(point) if self.faults is not None else None

    @property
    def fault_generation(self) -> int:
        return self.faults.generation if self.faults is not None else 0

    def stats(self) -> dict:
        out = self.engine.stats()
        out["pd"] = self.pd_stats.to_json(self.mode, {"num_bootstrapping": 0, "num_waiting_for_kv": 0,
                                                       "num_quarantined_pages": 0,
                                                       **self.side.gauges()})
        out["num_waiting"] += self.side.num_unscheduled()
        return out

    def flush_cache(self) -> bool:
        """Refused (False) while a PD transfer is open."""
        return not self.has_unfinished() and self.engine.flush_cache()

    def check_invariants(self) -> None:
        self.engine.check_invariants(self.decode.page_owners() if self.decode is not None else ())

    def add_eos_token_ids(self, token_ids: list[int]) -> None:
        self.engine.add_eos_token_ids(token_ids)


class _SideHooks(EngineHooks):
    def __init__(self, worker: PDWorker):
        self.worker = worker

    def on_finish(self, req: Request, out: EngineOutput) -> EngineOutput:
        prefill = self.worker.prefill
        if prefill is not None and req.request_id in prefill.by_request:
            ids, logprobs = out.new_token_ids, out.new_logprobs
            token = (logprobs[0] if logprobs else TokenLogprob(ids[0], 0.0, [])) if ids else None
            prefill.on_finish(req, token)
        return out

    def on_abort(self, req: Request) -> None:
        # e.g. a KV checksum mismatch; req already left Engine.requests: no second abort
        self.worker.side.abort(req.request_id)
