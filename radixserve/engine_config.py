"""EngineConfig: everything the engine process needs, as frozen flags (cross-flag checks: config_checks.py)."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from radixserve.config import opt
from radixserve.config_checks import check_disaggregation, check_kv_history, check_parallel, check_speculative

# The environment variable that sets --compile's default (tests/conftest.py pins it off for the suite).
COMPILE_ENV = "RADIXSERVE_COMPILE"
DISK_TIER_PAGE_SIZE = 16   # the default --page-size with a disk tier


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine process needs. Flag names follow SGLang's where one exists."""

    model_path: str | None = opt(None, "HF directory (config.json + *.safetensors) or a .gguf file; "
                                       "default: the embedded SmolLM2-135M-Instruct Q4_1 GGUF")
    dtype: str = opt("float32", "compute dtype (and KV dtype unless --kv-cache-dtype)", ("float32", "bfloat16"))
    device: str | None = opt(None, "cpu, cuda or cuda:N (default: cuda when torch sees a GPU, else cpu)")
    disable_cascade_attention: bool = opt(
        False, "turn off cascade decode attention (CPU: running requests that share a prefix read "
               "its KV once together; runner/attention/cascade.py)")
    attention_backend: str = opt("auto", "attention backend (auto: triton on CUDA when installed, else torch)",
                                 ("auto", "torch", "triton"))
    kv_cache_dtype: str = opt("auto", "KV storage dtype (auto: the compute dtype); fp8 stores K/V "
                                      "scaled per layer and KV head", ("auto", "float32", "bfloat16",
                                                                      "fp8_e4m3", "fp8_e5m2"))
    index_cache_dtype: str = opt("auto", "DSA (glm_moe_dsa) index-key storage: auto (the compute dtype) or "
                                         "fp8_e4m3 with one fp32 scale per token (docs/mla.md)", ("auto", "fp8_e4m3"))
    kv_history_dtype: str = opt(
        "same", "with an fp8 --kv-cache-dtype: auto = conversation history (prompt pages, the only pages the radix "
                "tree keeps) at the compute dtype, only pages a decode writes in fp8, so FP8 error never carries "
                "into the next turn (docs/runner.md); same = every page in --kv-cache-dtype", ("same", "auto"))
    kv_fp8_page_fraction: float = opt(
        0.25, "--kv-history-dtype auto: share of the KV pool's bytes given to fp8 decode pages (the rest: "
              "compute-dtype history pages)")
    quantization_param_path: str | None = opt(
        None, "JSON file of FP8 KV scales {\"k_scale\": [...], \"v_scale\": [...]}, one per layer "
              "(default: the checkpoint's k_scale/v_scale, else calibrated at start-up)")
    page_size: int | None = opt(
        None, "KV page size in tokens; unset: 1 (the radix cache reuses a prefix to the token, as SGLang), or "
              f"{DISK_TIER_PAGE_SIZE} with --hicache-storage-dir (the disk tier keeps one file per page)")
    max_total_tokens: int | None = opt(None, "KV capacity in tokens (overrides --kv-cache-memory-gb)")
    kv_cache_memory_gb: float = opt(1.0, "KV capacity in GiB when --max-total-tokens is not set")
    chunked_prefill_size: int = opt(1024, "token budget of one step (decode tokens + prefill chunk)")
    max_running_requests: int = opt(128, "most requests decoding at once")
    schedule_policy: str = opt("fcfs", "order of admission from the waiting queue", ("fcfs", "lpm"))
    lpm_queue_threshold: int = opt(128, "lpm falls back to fcfs when more requests than this wait")
    disable_radix_cache: bool = opt(False, "turn off prefix reuse across requests")
    enable_hierarchical_cache: bool = opt(
        False, "keep prefixes evicted from the device KV pool in a host-memory tier and load them "
               "back layer by layer while the forward runs (docs/hicache.md)")
    hicache_ratio: float = opt(2.0, "host tier size as a multiple of the device KV pool "
                                    "(unless --hicache-size)")
    hicache_size: float | None = opt(None, "host tier size in GiB (overrides --hicache-ratio)")
    hicache_write_policy: str = opt(
        "write_through", "when device pages are copied to host: write_through (as they enter the "
                         "radix tree), write_through_selective (on their second hit), write_back "
                         "(when evicted from the device)",
        ("write_through", "write_through_selective", "write_back"))
    hicache_storage_dir: str | None = opt(
        None, "a disk tier under the host tier: every page copied to host is also saved here, "
              "named by a hash of its token prefix, so it outlives restarts and is shared by "
              "workers of one model on this host (needs --enable-hierarchical-cache)")
    context_length: int | None = opt(None, "override the model's context length in tokens")
    num_threads: int | None = opt(None, "torch intra-op threads (default: all cores)")
    random_seed: int = opt(0, "seed for requests that bring none")
    speculative_algorithm: str | None = opt(
        None, "speculative decoding: ngram = draft tokens copied from earlier in the request's own "
              "prompt and output (or recent requests' outputs); draft = a self-draft model, "
              "the target's first --speculative-draft-layers layers with its own KV; drafts are "
              "verified in one step; EAGLE (alias NEXTN) = the checkpoint's NextN/MTP layer, or the "
              "trained head file given by --speculative-draft-model-path (on the default model: its "
              "packaged trained head), drafts a chain from the target's last hidden state; none = off "
              "(the default)",
        ("ngram", "draft", "EAGLE", "NEXTN", "none"))
    speculative_num_draft_tokens: int | None = opt(
        None, "ngram, draft: most draft tokens verified per request and step (a request's draft grows "
              "to this while its drafts are accepted; unset: 8); EAGLE: tokens per verify step, the "
              "last accepted one included, as SGLang counts them: --speculative-num-steps + 1")
    speculative_num_steps: int | None = opt(
        None, "EAGLE: draft steps per verify step, i.e. most draft tokens verified (unset: 3)")
    speculative_eagle_topk: int | None = opt(
        None, "EAGLE: draft candidates per step; only 1 (a chain) is supported")
    speculative_draft_min_prob: float | None = opt(
        None, "EAGLE: the chain stops before a draft token the draft head gives a probability below "
              "this (its confidence, as EAGLE-2's), so fewer tokens are verified where acceptance is "
              "unlikely; 0: always --speculative-num-steps (unset: 0; 0.4 with the default model's "
              "packaged head, measured in docs/speculative.md)")
    speculative_break_even_tokens: float | None = opt(
        None, "a step's fixed cost (reading the weights) in tokens of compute: with B requests "
              "decoding, a request drafts only while the fraction of its drafts accepted is above "
              "B / (B + this), where drafting still raises throughput (0: always draft; unset: 16 "
              "for float weights, 4 where --quantization runs a CPU int4/int8 kernel, whose cost "
              "grows with every token; measured in docs/speculative.md)")
    speculative_draft_layers: int | None = opt(
        None, "draft: how many of the target's first layers (with its final norm and LM head) "
              "make the self-draft model (with --speculative-draft-model-path: of that model's; "
              "default all)")
    speculative_draft_model_path: str | None = opt(
        None, "draft: a separate draft model (HF folder or .gguf) with the target's vocabulary; "
              "EAGLE: a trained draft head file (.safetensors, training/train_draft_head.py)")
    quantization: str = opt(
        "auto", "weight-only quantized linear layers for a GGUF model (docs/runner.md): auto (default) = "
                "int4-fp32 for a GGUF where its kernel runs (built, on a CPU), else none; int4-fp32 = the "
                "file's Q4_0 / Q4_1 / Q4_K weights x fp32 activations on radixserve's kernel, batch-invariant, "
                "fp32-class numerics; int4 = torch's int4 kernel (bf16 activations); int4-int8 = int8 "
                "activations (llama.cpp's kind of rounding), batch-invariant; int8 requantizes every linear "
                "weight per row; none = fp32 dequantization", ("none", "int8", "int4", "int4-int8", "int4-fp32",
                                                               "auto"))
    quantized_max_tokens: int | None = opt(
        None, "int4 / int8 / int4-fp32: steps of more than this many tokens run the quantized layers on "
              "their dequantization, kept alongside (bf16 where the CPU has native bf16, +2 bytes per "
              "weight; else, and always for int4-fp32, fp32, +4): the kernels beat fp32 only for a few "
              "tokens per step (docs/benchmarks.md); 0 = the kernel at every size, no float copy; unset: 16 "
              "(its AVX-512 path) or 8 (AVX2) where --quantization auto picks a kernel (0 under "
              "--enable-deterministic-inference), else 0")
    compile: str | None = opt(
        None,
        "compile the decode forward with torch.compile (Inductor, C++; one graph per batch size up to "
        "--torch-compile-max-bs, built at start-up, about a minute on a cold cache, seconds from the disk "
        "cache): on = fail over to eager with one log line if it cannot compile, auto = on where a C++ "
        f"compiler is found, off = eager (docs/runner.md); default auto, or ${COMPILE_ENV} (the test suite "
        "pins off)", ("auto", "on", "off"))
    enable_torch_compile: bool = opt(False, "SGLang's flag: the same as --compile on")
    torch_compile_max_bs: int = opt(
        1, "--compile: largest decode batch run compiled (larger steps run eagerly; each further bucket 2, "
           "4, .. adds to a cold start); default 1, a single stream, where compiling gains most")
    enable_deterministic_inference: bool = opt(
        False, "batch-invariant matmul and attention: a greedy or seeded request gives the same "
               "tokens whatever else is batched, chunked or cached (CPU only; slower, see docs)")
    enable_kv_checksum: bool = opt(
        False, "checksum each KV slot once computed and re-check it while it is in use (every "
               "--kv-checksum-interval steps and when the request ends): a request whose KV was "
               "overwritten ends as output_anomaly kv_checksum (docs/anomaly_guard.md)")
    kv_checksum_interval: int = opt(16, "--enable-kv-checksum: steps between re-checks of a "
                                        "running request's KV")
    torch_profiler_dir: str | None = opt(
        None, "serve POST /start_profile and /stop_profile: a torch profiler trace of the engine's "
              "steps, written to this directory (docs/profiling.md)")
    # tensor parallelism (docs/parallel.md); flag names are SGLang's
    tp_size: int = opt(1, "tensor-parallel ranks, one engine process each: rank 0 schedules and broadcasts "
                          "each step, every rank holds 1/N of the heads, MLP rows and vocabulary")
    ep_size: int = opt(1, "expert-parallel ranks inside the --tp-size group (must divide it): each holds "
                          "1/N of a MoE model's routed experts, whole when N = --tp-size; the router, shared "
                          "experts and attention stay tensor-parallel (docs/parallel.md)")
    cp_size: int = opt(1, "context-parallel ranks for prefill (tensor parallelism 1): each rank computes every "
                          "N-th token of a prefill step against all keys, the new KV all-gathered per layer; "
                          "decode runs unsplit on every rank (docs/parallel.md)")
    enable_layer_split: bool = opt(False, "with --cp-size > 1: each rank stores only its own layers' KV plus "
                                          "one scratch layer, which the owner fills by broadcast before "
                                          "attention (GLM's LayerSplit)")
    pp_size: int = opt(1, "pipeline-parallel stages, each one engine process or a --tp-size group (rank = stage x "
                          "--tp-size + tp rank): stage s holds consecutive layers (the first L %% N stages one "
                          "more), activations go point to point (docs/parallel.md)")
    pp_micro_batches: int | None = opt(None, "--pp-size > 1: micro-batches (by sequences) each step is cut into so "
                                             "the stages overlap (None: --pp-size)")
    nnodes: int = opt(1, "machines the ranks (--tp-size x --cp-size x --pp-size) span (an equal share each)")
    node_rank: int = opt(0, "this machine's index among --nnodes (0 serves HTTP; the others run ranks only)")
    dist_init_addr: str | None = opt(None, "host:port where rank 0 meets the other ranks (needed with "
                                           "--nnodes > 1; default: a free port on 127.0.0.1)")
    dist_timeout: float = opt(120.0, "seconds a rank waits in a collective (and at start-up) for the "
                                     "others before it fails with an error instead of hanging")
    # prefill/decode disaggregation (docs/disaggregation.md); flag names are SGLang's
    disaggregation_mode: str = opt(
        "null", "null = colocated; prefill = compute prompts and send their KV and first token "
                "to decode workers (runs the bootstrap service); decode = receive KV into "
                "preallocated pages and decode", ("null", "prefill", "decode"))
    disaggregation_bootstrap_port: int = opt(8998, "prefill: TCP port of the bootstrap and KV "
                                                   "transfer service (0: any free port)")
    disaggregation_bootstrap_host: str = opt("127.0.0.1", "prefill: address the bootstrap "
                                                          "service listens on")
    disaggregation_transfer_backend: str = opt("tcp", "KV transport (tcp: ZeroMQ over TCP; the "
                                                      "seam for RDMA engines is in the docs)",
                                               ("tcp",))
    disaggregation_transfer_timeout: float = opt(
        60.0, "decode: seconds a request may wait for its KV after its pages are preallocated "
              "before it fails (the abort handshake still guards its pages); prefill: seconds "
              "a request waits for its decode worker to ask for it")
    disaggregation_chunk_pages: int = opt(8, "KV pages per transfer write (one message)")
    disaggregation_unsafe_skip_abort_handshake: bool = opt(
        False, "TEST ONLY: decode frees an aborted transfer's pages at once and lands every write "
               "blindly (RDMA semantics), without waiting for the prefill side's safe-to-free "
               "answer; reproduces the KV slot reuse race")

    def __post_init__(self) -> None:
        if self.speculative_algorithm == "none":    # the flag's explicit off is the field's None
            object.__setattr__(self, "speculative_algorithm", None)
        if self.compile == "off" and self.enable_torch_compile:
            raise ValueError("--enable-torch-compile (compile on) contradicts --compile off: give one of them")
        if self.compile is None:    # read when a config is made, not when the module is imported
            object.__setattr__(self, "compile", os.environ.get(COMPILE_ENV, "auto"))
        if self.page_size is None:
            object.__setattr__(self, "page_size", 1 if self.hicache_storage_dir is None else DISK_TIER_PAGE_SIZE)
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.chunked_prefill_size < self.page_size:
            raise ValueError("chunked_prefill_size must be >= page_size")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.context_length is not None and self.context_length < 0:   # 0: the model's, as unset
            raise ValueError(f"--context-length must be >= 0, got {self.context_length}")
        if self.max_total_tokens is not None and self.max_total_tokens < 2 * self.page_size:
            raise ValueError("max_total_tokens must hold at least two pages")
        if self.hicache_ratio <= 0 or (self.hicache_size is not None and self.hicache_size <= 0):
            raise ValueError("--hicache-ratio and --hicache-size must be > 0")
        if self.hicache_storage_dir is not None and not self.enable_hierarchical_cache:
            raise ValueError("--hicache-storage-dir needs --enable-hierarchical-cache")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError("--enable-hierarchical-cache needs the radix cache "
                             "(drop --disable-radix-cache)")
        if self.kv_checksum_interval < 1:
            raise ValueError("kv_checksum_interval must be >= 1")
        check_speculative(self)
        if self.torch_compile_max_bs < 1:
            raise ValueError("--torch-compile-max-bs must be >= 1")
        if self.compile not in ("auto", "on", "off"):
            raise ValueError(f"--compile (or ${COMPILE_ENV}) must be auto, on or off, got {self.compile!r}")
        if self.quantized_max_tokens is not None and self.quantized_max_tokens < 0:
            raise ValueError("--quantized-max-tokens must be >= 0")
        if self.quantization in ("int4", "int8") and self.enable_deterministic_inference:
            raise ValueError(f"--quantization {self.quantization} cannot be combined with "
                             f"--enable-deterministic-inference: the quantized kernels are not "
                             f"proven batch-invariant (use --quantization none, int4-fp32 or auto)")
        if self.quantized_max_tokens and self.enable_deterministic_inference:
            raise ValueError("--quantized-max-tokens cannot be combined with --enable-deterministic-inference: a "
                             "row would take the kernel or the float copy by its step's token count")
        check_disaggregation(self)
        check_parallel(self)
        check_kv_history(self)
        if self.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")

    @property
    def world_size(self) -> int:
        """Engine processes: --tp-size x --cp-size x --pp-size (at most one of them above 1)."""
        return self.tp_size * self.cp_size * self.pp_size

    @property
    def is_eagle(self) -> bool:
        return self.speculative_algorithm in ("EAGLE", "NEXTN")

    @property
    def spec_max_draft(self) -> int:
        """Most draft tokens a verify step checks (EAGLE: its draft steps)."""
        if self.is_eagle:
            return self.speculative_num_steps or 3
        return self.speculative_num_draft_tokens or 8

    @property
    def compile_mode(self) -> str:
        """--compile, with --enable-torch-compile meaning on."""
        return "on" if self.enable_torch_compile else self.compile
