"""The cross-flag checks of EngineConfig (speculative decoding, PD, parallelism): each raises ValueError.

`config` is the EngineConfig being built (engine_config.py calls these from its __post_init__); it is
typed Any because importing EngineConfig here would make an import cycle."""
from __future__ import annotations

from typing import Any


def check_speculative(config: Any) -> None:
    """--speculative-*: the EAGLE flags, the draft budget, and what a draft model needs."""
    _check_eagle(config)
    if not 1 <= config.spec_max_draft <= 16:
        raise ValueError("speculative_num_draft_tokens must be in [1, 16]")
    r = config.speculative_break_even_tokens
    if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not r >= 0):   # nan fails >=
        raise ValueError(f"speculative_break_even_tokens must be a number >= 0, got {r!r}")
    draft_given = (config.speculative_draft_layers is not None
                   or config.speculative_draft_model_path is not None)
    head_given = config.is_eagle and config.speculative_draft_layers is None
    if (config.speculative_algorithm == "draft") != draft_given and not head_given:
        raise ValueError("--speculative-algorithm draft needs --speculative-draft-layers or "
                         "--speculative-draft-model-path, and they need it (or EAGLE, for a draft head "
                         "file given by --speculative-draft-model-path)")
    if config.speculative_draft_layers is not None and config.speculative_draft_layers < 1:
        raise ValueError("speculative_draft_layers must be >= 1")


def _check_eagle(config: Any) -> None:
    eagle_only = {"--speculative-num-steps": config.speculative_num_steps,
                  "--speculative-eagle-topk": config.speculative_eagle_topk,
                  "--speculative-draft-min-prob": config.speculative_draft_min_prob}
    if not config.is_eagle:
        given = [flag for flag, value in eagle_only.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} "
                             f"--speculative-algorithm EAGLE")
        return
    if config.speculative_num_steps is not None and not 1 <= config.speculative_num_steps <= 16:
        raise ValueError(f"--speculative-num-steps must be in [1, 16], got {config.speculative_num_steps}")
    if config.speculative_draft_min_prob is not None and not 0 <= config.speculative_draft_min_prob < 1:
        raise ValueError(f"--speculative-draft-min-prob must be in [0, 1), got {config.speculative_draft_min_prob}")
    if config.speculative_eagle_topk not in (None, 1):
        raise ValueError(f"--speculative-eagle-topk {config.speculative_eagle_topk}: only 1 is supported "
                         f"(a chain of drafts; tree drafts are not implemented)")
    steps = config.spec_max_draft
    if config.speculative_num_draft_tokens not in (None, steps + 1):
        raise ValueError(f"--speculative-num-draft-tokens {config.speculative_num_draft_tokens} with "
                         f"--speculative-eagle-topk 1 must be --speculative-num-steps + 1 = {steps + 1} "
                         f"(the last accepted token and {steps} drafts)")
    unsupported = {"--kv-cache-dtype fp8": config.kv_cache_dtype.startswith("fp8"),
                   "--tp-size > 1": config.tp_size > 1,
                   "--hicache-storage-dir": config.hicache_storage_dir is not None}
    named = [flag for flag, on in unsupported.items() if on]
    if named:
        raise ValueError(f"--speculative-algorithm {config.speculative_algorithm} cannot be combined with "
                         f"{', '.join(named)} yet")


def check_disaggregation(config: Any) -> None:
    """--disaggregation-*: no draft model on a PD worker, the bootstrap port, the timeout and chunk size."""
    if config.disaggregation_mode != "null" and config.speculative_algorithm == "draft":
        raise ValueError("--speculative-algorithm draft cannot run on a prefill or decode "
                         "worker: the draft model's KV is not transferred")
    if not 0 <= config.disaggregation_bootstrap_port <= 65535:
        raise ValueError("disaggregation_bootstrap_port must be in [0, 65535]")
    if config.disaggregation_transfer_timeout <= 0 or config.disaggregation_chunk_pages < 1:
        raise ValueError("disaggregation_transfer_timeout must be > 0 and "
                         "disaggregation_chunk_pages >= 1")


def check_parallel(config: Any) -> None:
    """--tp/ep/cp/pp-size, --nnodes and the --dist-* flags, and what parallel ranks do not build yet."""
    _check_pipeline(config)
    if config.tp_size < 1 or config.cp_size < 1:
        raise ValueError("--tp-size and --cp-size must be positive")
    if config.ep_size < 1 or config.tp_size % config.ep_size:
        raise ValueError(f"--ep-size {config.ep_size} must be a positive divisor of --tp-size {config.tp_size} (the "
                         "expert-parallel ranks are a split of the tensor-parallel group)")
    if config.nnodes < 1 or config.world_size % config.nnodes or not 0 <= config.node_rank < config.nnodes:
        raise ValueError(f"--nnodes must divide the {config.world_size} ranks (--tp-size x --cp-size x "
                         "--pp-size), and --node-rank be in [0, --nnodes)")
    if config.nnodes > 1 and config.dist_init_addr is None:
        raise ValueError("--nnodes > 1 needs --dist-init-addr host:port (rank 0's machine)")
    if not config.dist_timeout > 0:
        raise ValueError("dist_timeout must be > 0")
    if config.enable_layer_split and config.cp_size == 1:
        raise ValueError("--enable-layer-split needs --cp-size > 1")
    if config.enable_layer_split and config.enable_kv_checksum:
        raise ValueError("--enable-kv-checksum cannot check --enable-layer-split's KV (rank 0 stores only its "
                         "own layers and a scratch layer that changes every layer)")
    if config.world_size == 1:
        return
    _check_pd_layout(config)
    if config.cp_size > 1 and config.tp_size > 1:
        raise ValueError("--cp-size > 1 with --tp-size > 1 is not built yet (context-parallel ranks hold "
                         "whole weights)")
    ranks = f"--tp-size {config.tp_size}" if config.cp_size == 1 else f"--cp-size {config.cp_size}"
    speculative = config.speculative_algorithm == "draft" or (config.cp_size > 1 and config.speculative_algorithm)
    unsupported = {f"--speculative-algorithm {config.speculative_algorithm}": speculative,
                   "--enable-hierarchical-cache": config.enable_hierarchical_cache,
                   "an fp8 --kv-cache-dtype": config.kv_cache_dtype.startswith("fp8"),
                   "--enable-deterministic-inference": config.cp_size > 1 and config.enable_deterministic_inference,
                   f"--quantization {config.quantization}": config.tp_size > 1 and config.quantization not in ("none",
                                                                                                      "auto")}
    named = [flag for flag, on in unsupported.items() if on]
    if named:
        raise ValueError(f"{ranks} cannot be combined with {', '.join(named)} yet")


def _check_pd_layout(config: Any) -> None:
    """The PD layouts built (disagg/protocol.py KVLayout.mismatch): any prefill worker but PP (rank 0 sends every
    layer's KV and head) feeding a decode worker of one rank or TP (rank 0 receives, every rank keeps its heads)."""
    mode = config.disaggregation_mode
    if mode == "null" or config.pp_size > 1:      # PP: _check_pipeline names --disaggregation-mode
        return
    layout = (f"--tp-size {config.tp_size} --cp-size {config.cp_size}"
              f"{' --enable-layer-split' if config.enable_layer_split else ''}")
    if mode == "decode" and config.cp_size > 1:
        raise ValueError(f"--disaggregation-mode {mode} with {layout} is not built yet: the PD pairs built are a "
                         "prefill worker of one rank, --tp-size N or --cp-size N (with or without "
                         "--enable-layer-split; no --pp-size) and a decode worker of one rank or --tp-size N "
                         "(docs/disaggregation.md)")


def _check_pipeline(config: Any) -> None:
    """--pp-size: what runner/pp.py does not build is refused here, before any process starts."""
    if config.pp_size < 1 or (config.pp_micro_batches is not None and config.pp_micro_batches < 1):
        raise ValueError("--pp-size and --pp-micro-batches must be positive")
    if config.pp_size == 1:
        if config.pp_micro_batches is not None:
            raise ValueError("--pp-micro-batches needs --pp-size > 1")
        return
    unsupported = {"--cp-size > 1": config.cp_size > 1,
                   f"--speculative-algorithm {config.speculative_algorithm}": config.speculative_algorithm is not None,
                   "--disaggregation-mode": config.disaggregation_mode != "null",
                   "--enable-hierarchical-cache": config.enable_hierarchical_cache,
                   "an fp8 --kv-cache-dtype": config.kv_cache_dtype.startswith("fp8"),
                   "--enable-deterministic-inference": config.enable_deterministic_inference,
                   "--enable-kv-checksum": config.enable_kv_checksum,
                   f"--quantization {config.quantization}": config.quantization not in ("none", "auto"),
                   "--compile on": config.compile_mode == "on"}   # auto decodes eagerly (compile_setup)
    named = [flag for flag, on in unsupported.items() if on]
    if named:
        raise ValueError(f"--pp-size {config.pp_size} cannot be combined with {', '.join(named)} yet")


def check_model_fit(config: Any, model_config: Any) -> None:
    """--pp-size and --tp-size against a ModelConfig: ValueError naming the flag, its value and the model's count."""
    check_stages_fit(config.pp_size, config.tp_size, model_config.num_layers, model_config.hidden_size)
    check_heads_fit(config.tp_size, model_config.num_heads, 1 if model_config.mla else model_config.num_kv_heads)
    moe = model_config.moe
    check_experts_fit(config.ep_size, moe.num_experts if moe else None, model_config.architecture)


def check_stages_fit(pp_size: int, tp_size: int, num_layers: int, hidden_size: int) -> None:
    if pp_size > num_layers:
        raise ValueError(f"--pp-size {pp_size} exceeds the model's {num_layers} layers")
    if pp_size > 1 and hidden_size % tp_size:
        raise ValueError(f"--pp-size {pp_size} with --tp-size {tp_size}: the hidden size {hidden_size} does not "
                         "divide into the ranks' parts of the residual sent between stages")


def check_heads_fit(tp_size: int, num_heads: int, num_kv_heads: int) -> None:
    if num_heads % tp_size or (num_kv_heads % tp_size if num_kv_heads >= tp_size else tp_size % num_kv_heads):
        raise ValueError(f"--tp-size {tp_size} does not divide {num_heads} attention heads and {num_kv_heads} KV "
                         "heads (the model's; KV heads fewer than ranks must divide --tp-size)")


def check_experts_fit(ep_size: int, num_experts: int | None, architecture: str = "the model") -> None:
    if ep_size > 1 and num_experts is None:
        raise ValueError(f"--ep-size {ep_size} needs a mixture-of-experts model ({architecture} has no routed experts)")
    if num_experts is not None and num_experts % ep_size:
        raise ValueError(f"--ep-size {ep_size} does not divide the {num_experts} routed experts")


def check_kv_history(config: Any) -> None:
    """--kv-history-dtype auto: an fp8 --kv-cache-dtype, a page fraction in (0, 1), and none of the paths that
    cannot carry pages of two dtypes yet (docs/runner.md lists them)."""
    if not 0 < config.kv_fp8_page_fraction < 1:
        raise ValueError(f"--kv-fp8-page-fraction must be in (0, 1), got {config.kv_fp8_page_fraction}")
    if config.kv_history_dtype != "auto":
        return
    if not config.kv_cache_dtype.startswith("fp8"):
        raise ValueError(f"--kv-history-dtype auto keeps history at the compute dtype and decode pages in fp8: "
                         f"it needs --kv-cache-dtype fp8_e4m3 or fp8_e5m2 (got {config.kv_cache_dtype})")
    if config.max_total_tokens is not None:
        check_history_split(token_history_split(config.max_total_tokens // config.page_size,
                                                config.kv_fp8_page_fraction))
    unsupported = {f"--speculative-algorithm {config.speculative_algorithm}": config.speculative_algorithm is not None,
                   "--enable-hierarchical-cache": config.enable_hierarchical_cache,
                   "--disaggregation-mode": config.disaggregation_mode != "null",
                   "--attention-backend triton": config.attention_backend == "triton",
                   "--compile on": config.compile_mode == "on",
                   "--enable-deterministic-inference": config.enable_deterministic_inference,
                   "--enable-kv-checksum": config.enable_kv_checksum}
    named = [flag for flag, on in unsupported.items() if on]
    if named:
        raise ValueError(f"--kv-history-dtype auto cannot be combined with {', '.join(named)} yet")


def token_history_split(num_pages: int, fraction: float) -> tuple[int, int]:
    """(history pages, round(fraction * num_pages) fp8 pages) of a --max-total-tokens pool."""
    fp8 = round(num_pages * fraction)
    return num_pages - fp8, fp8


def check_history_split(split: tuple[int, int]) -> None:
    if split[0] < 2 or split[1] < 1:
        raise ValueError(f"--kv-history-dtype auto: the KV pool splits into {split[0]} history and {split[1]} fp8 "
                         f"pages; it needs at least 2 and 1 (raise the pool size or change --kv-fp8-page-fraction)")
