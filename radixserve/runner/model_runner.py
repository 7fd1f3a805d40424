"""ModelRunner: owns the model, the paged KV cache and the sampler; run(batch) = one forward + sampling."""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterable

import torch

from radixserve.engine.runner_api import ScheduledSeq, SeqResult
from radixserve.engine_config import EngineConfig
from radixserve.layers import int4_fp32
from radixserve.layers.batch_invariant import check_row_invariance
from radixserve.layers.parallel import Collectives
from radixserve.layers.sampler import Sampler, token_logprobs
from radixserve.models.model_config import ModelConfig
from radixserve.models.registry import model_class
from radixserve.models.sliding_window import check_window
from radixserve.outputs import TokenLogprob
from radixserve.runner import kv_scales, kv_transfer
from radixserve.runner.attention.base import AttentionBackend, create_backend
from radixserve.runner.attention.sparse import SparseBackend, add_index_keys
from radixserve.runner.batch import StepBatch, build_step
from radixserve.runner.compile_setup import load_decode_graphs
from radixserve.runner.device import huge_pages_mb, resolve_device, reuse_freed_cpu_buffers
from radixserve.runner.disk_kv import DiskKV, fingerprint
from radixserve.runner.draft import DraftModel
from radixserve.runner.host_kv import HostKV
from radixserve.runner.kv_cache import FP8_DTYPES, KVCache, KVPages
from radixserve.runner.kv_sizing import DTYPES, history_split, index_key_layers, kv_storage_dtype, num_pages
from radixserve.runner.mixed_kv import MixedKVCache
from radixserve.runner.mtp import MTPDraft
from radixserve.runner.structured import StructuredOutput
from radixserve.sampling_params import SamplingParams
from radixserve.weights.checkpoint_config import resolve_quantization, resolve_quantized_max_tokens
from radixserve.weights.loader import load_checkpoint, load_weights
from radixserve.weights.nextn_loader import load_draft_head, load_nextn, nextn_tensors
from radixserve.weights.paths import resolve_model_path

logger = logging.getLogger(__name__)

class ModelRunner:
    """The Runner protocol (engine/runner_api.py) over a real model. CPU memory: weights twice
    (plain + oneDNN-packed; quantized layers packed only), the KV cache, the DecodeMirror (<= 2 GiB)."""

    kv_head_start = 0     # the first of the model's KV heads this rank caches (from_config sets it under TP)
    tp: Collectives | None = None

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 checkpoint_kv_scales: dict[str, torch.Tensor] | None = None,
                 draft_model: torch.nn.Module | None = None):
        """`model` (and `draft_model`, with EAGLE the NextNLayer): loaded on CPU, not yet prepared; under TP this rank's
        shard. Raises ValueError for a missing device, bad FP8 scales, a context longer than the model's or than its
        sliding window (models/sliding_window.py: radixserve has no windowed attention), deterministic inference
        without a batch-invariant matmul here, or a draft vocabulary that is not the target's."""
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.page_size = config.page_size
        self.max_context_len = config.context_length or model_config.max_position_embeddings
        if self.max_context_len > model_config.max_position_embeddings:
            raise ValueError(f"context_length {self.max_context_len} exceeds the model's "
                             f"{model_config.max_position_embeddings} positions")
        check_window(model_config.sliding_window, self.max_context_len)
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self.model = model
        deterministic = config.enable_deterministic_inference
        if deterministic:
            check_row_invariance(self.dtype, self.device)
        self.model.prepare(self.dtype, self.device, batch_invariant=deterministic,
                           quantized_max_tokens=config.quantized_max_tokens or 0)
        self.model.eval()
        heads, head_dim, latent = model_config.kv_shape
        if not latent:
            heads = getattr(model, "num_kv_heads", heads)   # this rank's
        mixed = config.kv_history_dtype == "auto"
        dsa = model_config.dsa
        split = history_split(config, model_config, heads, self.kv_layers(model_config)) if mixed else None
        self.num_pages = sum(split) if split else num_pages(config, model_config, heads, self.kv_layers(model_config))
        self.num_fp8_pages = split[1] if split else 0
        kv_dtype = kv_storage_dtype(config)
        self.kv_scales = self._kv_scales(kv_dtype, checkpoint_kv_scales or {})
        scales = (self.kv_scales.k, self.kv_scales.v) if self.kv_scales else (None, None)
        shape = (self.kv_layers(model_config), self.page_size, heads, head_dim)
        self.kv = (MixedKVCache.build(shape[0], *split, *shape[1:], kv_dtype, self.device, self.dtype, *scales, latent)
                   if split else KVCache(shape[0], self.num_pages, *shape[1:], kv_dtype, self.device, self.dtype,
                                         *scales, latent=latent))
        if dsa is not None and deterministic:
            raise ValueError("glm_moe_dsa (DSA) does not run with --enable-deterministic-inference yet")
        self.backend: AttentionBackend = create_backend("torch" if mixed else config.attention_backend, self.kv,
                                                        self.device, batch_invariant=deterministic,
                                                        cascade=not config.disable_cascade_attention,
                                                        mirror=dsa is None)
        if dsa is not None:   # the full indexer layers (and an EAGLE draft's layer N), as this runner stores them
            add_index_keys(self.kv, self.index_key_layers(index_key_layers(model_config, self.kv.num_layers)),
                           dsa.index_head_dim, self.dtype, fp8=config.index_cache_dtype != "auto")
            self.backend = SparseBackend(self.backend)
        self.host_kv = self._host_kv(config) if config.enable_hierarchical_cache else None
        self.decode_graphs = load_decode_graphs(self.model, config, self.device)
        self.draft = None if config.is_eagle else self._draft_model(config, draft_model)
        self.mtp = MTPDraft.build(config, draft_model, self.kv, self.dtype, self.device) if config.is_eagle else None
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids)
        self.structured = StructuredOutput(config.model_path, self.vocab_size,
                                           self.eos_token_ids)

    def kv_layers(self, model_config: ModelConfig) -> int:
        """KV storage layers this runner holds (fewer under LayerSplit, runner/cp.py; +1 for EAGLE, runner/mtp.py)."""
        return model_config.num_layers + self.config.is_eagle

    def index_key_layers(self, full_layers: tuple[int, ...]) -> tuple[int, ...]:
        """Storage layers of `full_layers`' DSA index keys (LayerSplit, runner/cp.py: its own layers or the scratch)."""
        return full_layers

    @classmethod
    def from_config(cls, config: EngineConfig, tp: Collectives | None = None, **kwargs) -> ModelRunner:
        """Load config.model_path (None: the embedded GGUF), under tensor parallelism `tp` only this rank's shard
        (float weights: --quantization auto means none); sets torch's thread count (default: this rank's cores).
        `kwargs` go to the constructor (a subclass's own arguments)."""
        local_ranks = config.world_size // config.nnodes
        torch.set_num_threads(config.num_threads or max(1, (os.cpu_count() or 1) // local_ranks))
        on_cpu = resolve_device(config.device).type == "cpu"
        if on_cpu:
            reuse_freed_cpu_buffers()
        path = resolve_model_path(config.model_path)
        start = time.perf_counter()
        logger.info("loading the model from %s", path)
        isa = int4_fp32.chosen_isa() if on_cpu else None
        own_kernel = isa in int4_fp32.VECTOR_ISAS
        quantization = ("none" if (tp is not None or config.pp_size > 1) and config.quantization == "auto" else
                        resolve_quantization(config.quantization, path, own_kernel))
        if quantization == "none" and config.quantized_max_tokens:
            logger.warning("--quantized-max-tokens %d has no effect: no layer runs quantized (--quantization %s "
                           "serves %s fp32 here)", config.quantized_max_tokens, config.quantization, path)
        config = dataclasses.replace(config, quantization=quantization,
                                     quantized_max_tokens=resolve_quantized_max_tokens(config, quantization, isa))
        model_config, weights = load_checkpoint(path, quantization)
        model = model_class(model_config)(model_config, tp=tp, ep_size=config.ep_size)
        weights = cls.select_part(model, weights, tp=tp, **kwargs)
        draft_tensors: list[tuple[str, torch.Tensor]] = []
        if config.is_eagle:
            weights = nextn_tensors(weights, model_config.num_layers, draft_tensors)
        scales = load_weights(model, weights)
        draft = None
        if config.is_eagle:
            head = config.speculative_draft_model_path
            draft = load_draft_head(model, head) if head is not None else load_nextn(model, draft_tensors, path)
        elif config.speculative_draft_model_path is not None:
            draft_config, draft_weights = load_checkpoint(
                resolve_model_path(config.speculative_draft_model_path))
            draft = model_class(draft_config)(draft_config)
            load_weights(draft, draft_weights)
        runner = cls(model, model_config, config, scales, draft, **kwargs)
        runner.kv_head_start, runner.tp = kv_transfer.first_kv_head(model_config, tp), tp
        logger.info("loaded %s (%s, %d layers, quantization %s) in %.1f s on %s; KV: %d pages x %d tokens, "
                    "%s; transparent huge pages: %s MiB", path, model_config.architecture,
                    model_config.num_layers, quantization, time.perf_counter() - start, runner.device,
                    runner.num_pages, runner.page_size, str(runner.kv.dtype).removeprefix("torch."),
                    huge_pages_mb())
        return runner

    @classmethod
    def select_part(cls, model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    **kwargs) -> Iterable[tuple[str, torch.Tensor]]:
        """Before loading: the checkpoint tensors (name, tensor) this runner loads into `model`, all by default (a
        pipeline stage, runner/pp.py, first cuts `model` to its layers and keeps their tensors only)."""
        return weights

    def _kv_scales(self, kv_dtype: torch.dtype, from_checkpoint: dict[str, torch.Tensor]) -> kv_scales.KVScales | None:
        if kv_dtype not in FP8_DTYPES.values():
            return None
        mc, path = self.model_config, self.config.quantization_param_path
        heads = mc.kv_shape.num_heads
        scales = kv_scales.from_checkpoint(from_checkpoint, mc.num_layers, heads)
        if scales is None and path is not None:
            scales = kv_scales.from_file(path, mc.num_layers, heads)
        if scales is None:
            scales = kv_scales.calibrate(self.model, mc.num_layers, heads, self.vocab_size,
                                         self.max_context_len, kv_dtype, self.device)
            logger.warning("FP8 KV: neither the checkpoint nor --quantization-param-path gives KV "
                           "scales; calibrated them over %d tokens: k %.4g..%.4g, v %.4g..%.4g",
                           kv_scales.CALIBRATION_TOKENS, scales.k.min(), scales.k.max(),
                           scales.v.min(), scales.v.max())
        else:
            logger.info("FP8 KV scales from the %s", scales.source)
        return scales

    def _host_kv(self, config: EngineConfig) -> HostKV:
        """The host tier: --hicache-size GiB, else --hicache-ratio x the device pages."""
        page_bytes = self.kv.slot_bytes * self.page_size
        num = (int(config.hicache_size * 2**30) // page_bytes if config.hicache_size is not None
               else int(self.num_pages * config.hicache_ratio))
        host = HostKV(self.kv, num)
        logger.info("host KV tier: %d pages (%.2f GiB), write policy %s", num,
                    num * page_bytes / 2**30, config.hicache_write_policy)
        if config.hicache_storage_dir is not None:
            kv = self.kv
            host.disk = DiskKV(host.host, config.hicache_storage_dir, fingerprint(
                str(resolve_model_path(config.model_path)), kv.num_layers, kv.num_kv_heads,
                kv.head_dim, kv.dtype, self.page_size))
        return host

    def info(self) -> dict:
        out = {"device": str(self.device), "attention_backend": self.backend.name,
               "kv_cache_dtype": str(self.kv.dtype).removeprefix("torch."),
               "deterministic_inference": self.config.enable_deterministic_inference,
               "quantization": self.config.quantization}
        if self.num_fp8_pages:
            out["kv_history_dtype"] = str(self.kv.history_dtype).removeprefix("torch.")
            out["kv_pages"] = {"history": self.num_pages - self.num_fp8_pages, "fp8": self.num_fp8_pages}
        if self.host_kv is not None:
            out.update(self.host_kv.info())
        if self.kv_scales is not None:
            out["kv_scales"] = self.kv_scales.describe()
        if self.mtp is not None:
            out["nextn_draft"] = dict(self.mtp.layer.sources)
        if self.decode_graphs is not None:
            out["compile"] = self.decode_graphs.info()
        return out

    def validate_params(self, params: SamplingParams) -> None:
        """Raises InvalidRequest when the request's grammar does not compile."""
        if params.grammar is not None:
            self.structured.check(params.grammar, params.json_schema_param)

    def grammar_pending(self, params: SamplingParams) -> bool:
        """Whether validate_params would compile a new grammar (seconds: engine/loop.py offloads it)."""
        return params.grammar is not None and not self.structured.is_compiled(params.grammar)

    def corrupt_kv(self, page_ids: list[int], mode: str, source_page_ids: list[int] | None,
                   seed: int) -> None:
        """chaos/kv_corrupt.py: overwrite `page_ids` in every target layer with Gaussian noise of their own
        mean and std ("noise") or `source_page_ids`' KV ("swap", "stale"); the DecodeMirror is dropped."""
        if mode in ("swap", "stale"):
            data = self.kv.export_pages(list(source_page_ids or ()))
        else:
            data = self.kv.export_pages(page_ids)
            gen = torch.Generator().manual_seed(seed)

            def noise(x: torch.Tensor) -> torch.Tensor:
                f = x.float()
                dims = tuple(range(1, f.dim()))
                mean, std = f.mean(dims, keepdim=True), f.std(dims, keepdim=True)
                return (mean + std * torch.randn(f.shape, generator=gen)).to(x.dtype)
            data = KVPages(noise(data.k), noise(data.v), data.side)
        if self.mtp is not None:   # the target's layers only: the draft's KV (and index keys) stays its own
            kept, draft = self.kv.export_pages(page_ids), self.kv.num_layers - 1
            data.k[-1], data.v[-1] = kept.k[-1], kept.v[-1]
            for name in data.side:
                if draft in self.kv.side_layers(name):
                    data.side[name][-1] = kept.side[name][-1]
        self.kv.import_pages(page_ids, data)
        mirror = getattr(self.backend, "mirror", None)
        if mirror is not None:
            mirror.reset()

    def kv_slot_checksums(self, slots: list[int]) -> list[int]:
        """The target's layers only: an MTP / EAGLE draft rewrites its own KV layer (the last) by design."""
        return self.kv.slot_checksums(slots, self.kv.num_layers - 1 if self.mtp is not None else None)

    def kv_layout(self) -> dict:
        """KVLayout fields: this rank's cache (export_kv holds its layers 0..num_layers-1 in order) and the group's."""
        if getattr(self, "_identity", None) is None:
            self._identity = kv_transfer.model_identity(self.model_config, self.model)
        kv, config = self.kv, self.config
        return {"page_size": self.page_size, "kv_dtype": str(kv.dtype).removeprefix("torch."),
                "num_layers": kv.num_layers, "num_kv_heads": self.model_config.kv_shape.num_heads,
                "head_dim": kv.head_dim, "model": self._identity, "layer_ids": tuple(range(kv.num_layers)),
                "tp_size": config.tp_size, "cp_size": config.cp_size, "pp_size": config.pp_size,
                "layer_split": config.enable_layer_split}

    @property
    def export_gathers(self) -> bool:
        """Whether every rank runs export_kv (TPRunner.export_kv sends the followers KVExport): GQA under TP."""
        return self.tp is not None and self.tp.size > 1 and not self.kv.latent

    def export_kv(self, page_ids: list[int]) -> bytes:
        """The pages' bytes with every KV head of the model (gathered at rank 0 under TP; a follower gets b"")."""
        pages = self.kv.export_pages(page_ids)
        if self.export_gathers:
            pages = kv_transfer.gather_kv_heads(pages, self.tp, self.model_config)
        return b"" if pages is None else kv_transfer.pack_pages(pages)

    def import_kv(self, page_ids: list[int], data: bytes, foreign: bool) -> None:
        """Write another worker's export_kv bytes (every KV head) into `page_ids`, keeping this rank's KV heads under
        TP; `foreign` (pages of a sequence that already ran) drops the DecodeMirror. ValueError if they do not fit."""
        heads = (self.model_config.kv_shape.num_heads, self.kv_head_start)
        self.kv.import_pages(page_ids, kv_transfer.unpack_pages(self.kv, len(page_ids), data, heads))
        mirror = getattr(self.backend, "mirror", None)
        if foreign and mirror is not None:
            mirror.reset()

    @torch.inference_mode()
    def forward(self, batch: list[ScheduledSeq]) -> tuple[StepBatch, torch.Tensor]:
        """One forward pass over a non-empty batch: the step and its logits (R, V) fp32 (a TP follower's whole step)."""
        step = build_step(batch, self.page_size, self.device)
        attn = self.backend.prepare(step)
        if self.decode_graphs is not None and (out := self.decode_graphs.run(step, attn)) is not None:
            if self.mtp is not None:
                self._hidden = out[1]
            return step, out[0]
        if self.mtp is not None:   # the draft reads every row's hidden state
            self._hidden = self.model.final_hidden(step.input_ids, step.positions, attn)
            return step, self.model.lm_head(self._hidden.index_select(0, step.logit_rows)).float()
        return step, self.model(step.input_ids, step.positions, attn, step.logit_rows)

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> list[SeqResult]:
        """One forward pass, then sampling and logprobs; results follow batch order."""
        if not batch:
            return []
        step, logits = self.forward(batch)
        plain = [(s, r) for s, r in zip(batch, step.sample_rows) if r is not None and not s.draft]
        sampled: list[int] = []
        sampled_lps: list[TokenLogprob] | None = None
        if plain:
            rows = [s for s, _ in plain]
            sample_idx = [r for _, r in plain]
            picked = logits if len(sample_idx) == logits.shape[0] else logits[sample_idx]
            constrained = any(r.params.grammar is not None for r in rows)
            mask = self.structured.token_mask(rows, self.device) if constrained else None
            sampled = self.sampler.sample(picked, rows, mask)
            sampled_lps = self.sampler.logprobs(picked, sampled, rows)
        results = []
        num_plain = 0
        for seq, sample_row, prompt in zip(batch, step.sample_rows, step.prompt_rows):
            token_ids: tuple[int, ...] = ()
            lps: list[TokenLogprob] | None = None
            if sample_row is not None and seq.draft:
                verify_logits = logits[sample_row:sample_row + len(seq.draft) + 1]
                ids, lps = self.sampler.verify(verify_logits, seq, seq.draft)
                token_ids = tuple(ids)
            elif sample_row is not None:
                token_ids = (sampled[num_plain],)
                lps = sampled_lps[num_plain:num_plain + 1] if sampled_lps is not None else None
                num_plain += 1
            prompt_lps = None
            if prompt is not None:
                first, targets = prompt
                rows = logits[first:first + len(targets)]
                k = seq.params.prompt_logprobs or 0
                prompt_lps = (token_logprobs(rows, torch.tensor(targets, device=self.device), k)
                              if targets else [])
            wanted = lps is not None and seq.params.wants_logprobs
            results.append(SeqResult(seq.request_id, token_ids, tuple(lps) if wanted else None, prompt_lps))
        if self.draft is not None:
            self.draft.sync(step)
            results = self._propose(batch, results)
        elif self.mtp is not None:
            drafts = self.mtp.extend(batch, step, self._hidden, results)
            results = [dataclasses.replace(r, next_draft=tuple(d)) if d else r
                       for r, d in zip(results, drafts)]
        return results


    def _draft_model(self, config: EngineConfig, separate: torch.nn.Module | None) -> DraftModel | None:
        """--speculative-algorithm draft: the target's first layers, or `separate` prepared."""
        if config.speculative_algorithm != "draft":
            return None
        model = self.model
        if separate is not None:
            if separate.config.vocab_size != self.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({separate.config.vocab_size}) is "
                                 f"not the target's ({self.vocab_size})")
            separate.prepare(self.dtype, self.device)
            model = separate.eval()
        layers = config.speculative_draft_layers or model.config.num_layers
        return DraftModel(model, layers, self.num_pages, self.page_size, self.dtype, self.device)

    def _propose(self, batch: list[ScheduledSeq], results: list[SeqResult]) -> list[SeqResult]:
        asking = [(i, s) for i, (s, r) in enumerate(zip(batch, results))
                  if s.propose > 0 and r.token_ids]
        if not asking:
            return results
        drafts = self.draft.propose(
            [s for _, s in asking], [results[i].token_ids[-1] for i, _ in asking],
            [s.start_pos + len(s.input_ids) - len(s.draft) + len(results[i].token_ids) - 1
             for i, s in asking])
        for (i, _), draft in zip(asking, drafts):
            results[i] = dataclasses.replace(results[i], next_draft=tuple(draft))
        return results
