"""The engine process's composition root: runner, Engine with its hooks (KV checksums, fault injection, the profiler), and on PD workers the PDWorker."""
from __future__ import annotations

from dataclasses import dataclass

from radixserve.engine.hooks import EngineHooks
from radixserve.engine.loop import EngineParts, RunnerFactory
from radixserve.engine.messages import EngineInfo
from radixserve.engine_config import EngineConfig


def engine_hooks(config: EngineConfig) -> list[EngineHooks]:
    """The hooks `config` asks for (--enable-kv-checksum)."""
    from radixserve.engine.kv_checksum import ChecksumHooks
    return [ChecksumHooks(config.kv_checksum_interval)] if config.enable_kv_checksum else []


@dataclass(frozen=True)
class EngineFactory:
    """Builds EngineParts (engine/loop.py) in the spawned process, so `runner_factory` must be a
    module-level function. `fault_injection`: attach chaos/ and accept the `fault` call."""

    runner_factory: RunnerFactory
    fault_injection: bool = False

    def __call__(self, config: EngineConfig, eos_token_ids: frozenset[int]) -> EngineParts:
        from radixserve.engine.engine import Engine
        from radixserve.runner.profiler import ProfilerHooks
        runner = self.runner_factory(config)
        hooks = engine_hooks(config)
        calls = {}
        faults = None
        if self.fault_injection:
            from radixserve.chaos.engine_faults import EngineFaults
            faults = EngineFaults()
            hooks.append(faults)
            calls["fault"] = faults.fault
        if config.torch_profiler_dir:
            profiler = ProfilerHooks(config.torch_profiler_dir)
            hooks.append(profiler)
            calls["profile"] = profiler.profile
        if config.disaggregation_mode == "null":
            driven = engine = Engine(config, runner, eos_token_ids, hooks)
        else:
            from radixserve.disagg.worker import PDWorker
            driven = PDWorker(config, runner, eos_token_ids, hooks)
            engine = driven.engine
            if faults is not None:
                faults.attach_pd(driven)
        info = EngineInfo(max_context_len=engine.max_request_tokens, page_size=engine.page_size,
                          disaggregation_mode=config.disaggregation_mode,
                          bootstrap_address=getattr(driven, "bootstrap_address", None))
        return EngineParts(driven, info, calls)
