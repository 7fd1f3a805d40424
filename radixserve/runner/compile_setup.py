"""Whether and how the runner compiles its decode forward (`--compile auto|on|off`): the checks, the cache key (C61)
and the eager fallback with one log line (docs/runner.md "Compiled decode")."""
from __future__ import annotations

import dataclasses
import logging
import pathlib

import torch

from radixserve.engine_config import EngineConfig
from radixserve.runner.compiled_decode import DecodeGraphs, compiler_missing, graph_key
from radixserve.weights.paths import resolve_model_path

logger = logging.getLogger(__name__)

# EngineConfig fields that cannot change a compiled decode graph (scheduling, tiers, serving, compile's own on/off);
# every other field is in the key, so a new field is keyed until someone argues it out (tests/unit/test_compile_key.py).
NOT_IN_KEY = frozenset({
    "model_path", "compile", "enable_torch_compile", "max_total_tokens", "kv_cache_memory_gb", "chunked_prefill_size",
    "max_running_requests", "schedule_policy", "lpm_queue_threshold", "disable_radix_cache",
    "enable_hierarchical_cache", "hicache_ratio", "hicache_size", "hicache_write_policy", "hicache_storage_dir",
    "enable_kv_checksum", "kv_checksum_interval", "torch_profiler_dir", "dist_init_addr", "dist_timeout",
    "disaggregation_mode", "disaggregation_bootstrap_port", "disaggregation_bootstrap_host",
    "disaggregation_transfer_timeout", "disaggregation_chunk_pages", "quantization_param_path",
    # speculation changes which steps reach a graph, not the graph (a verify step that fits a bucket is one more
    # input to it); an EAGLE / NextN draft's one difference, the hidden-state output, is keyed as "hidden"
    "speculative_algorithm", "speculative_num_draft_tokens", "speculative_num_steps", "speculative_eagle_topk",
    "speculative_draft_min_prob", "speculative_break_even_tokens", "speculative_draft_layers",
    "speculative_draft_model_path",
})


def _unsupported(config: EngineConfig, device: torch.device, model: torch.nn.Module) -> str | None:
    """Why this runner's decode cannot be compiled (None: it can)."""
    if device.type != "cpu":
        return f"device {device} (CPU only)"
    if config.tp_size > 1 or config.pp_size > 1:
        return "--tp-size or --pp-size > 1"
    if config.kv_history_dtype == "auto":
        return "--kv-history-dtype auto"
    if config.enable_deterministic_inference:
        return "--enable-deterministic-inference (its batch-invariant matmuls are eager-only)"
    if getattr(model.config, "mla", None) is not None:
        return "MLA attention"
    return None


def model_files(model_path: str | None) -> list:
    """(name, bytes, mtime ns) of the checkpoint's files: a changed or replaced checkpoint gets a new key."""
    path = pathlib.Path(resolve_model_path(model_path))
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]


def key_fields(config: EngineConfig, model: torch.nn.Module, max_bs: int) -> dict:
    """What the graphs depend on besides torch and the CPU (graph_key adds those)."""
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in NOT_IN_KEY}
    row_paths = sorted({str(getattr(m, "row_path", None)) for m in model.modules() if hasattr(m, "row_paths")})
    return {"config": fields, "model": model_files(config.model_path), "max_bs": max_bs, "row_paths": row_paths,
            "hidden": config.is_eagle,
            "params": [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]}


def load_decode_graphs(model: torch.nn.Module, config: EngineConfig, device: torch.device) -> DecodeGraphs | None:
    """The compiled decode, warmed up (compiled or read from the disk cache) per bucket; None to decode eagerly:
    --compile off, an unsupported runner, no compiler under auto, or any compile failure (one log line)."""
    mode = config.compile_mode
    if mode == "off":
        return None
    say = logger.info if mode == "auto" else logger.warning
    why = _unsupported(config, device, model) or (compiler_missing() if mode == "auto" else None)
    if why is not None:
        say("compiled decode off, decoding eagerly: %s", why)
        return None
    # Steps over --quantized-max-tokens run quantized layers on their float copy; the graphs stay on the kernel.
    quantized = any(getattr(m, "quantized", False) for m in model.modules())
    cap = config.quantized_max_tokens if quantized and config.quantized_max_tokens else 1 << 30
    max_bs = min(config.torch_compile_max_bs, config.max_running_requests, cap)
    graphs = DecodeGraphs(model, max_bs, graph_key(key_fields(config, model, max_bs)), device, hidden=config.is_eagle)
    try:
        graphs.warm_up()
    except Exception as exc:   # Inductor raises many kinds (no compiler, a lowering it lacks); each means eager
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        logger.warning("compiled decode failed, decoding eagerly: %s: %s", type(exc).__name__, reason[:300])
        torch._dynamo.reset()
        return None
    return graphs
