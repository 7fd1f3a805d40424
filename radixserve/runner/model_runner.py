"""ModelRunner: owns the model, the paged KV cache and the sampler; run(batch) = one forward + sampling."""
from __future__ import annotations

import logging
import os
import time

import torch

from radixserve.config import EngineConfig
from radixserve.engine.runner_api import RunnerOutput, ScheduledBatch, SeqResult
from radixserve.layers.sampler import Sampler, token_logprobs
from radixserve.models.model_config import ModelConfig
from radixserve.models.registry import model_class
from radixserve.outputs import TokenLogprob
from radixserve.runner.attention.base import AttentionBackend
from radixserve.runner.attention.torch_backend import TorchAttentionBackend
from radixserve.runner.batch import build_step
from radixserve.runner.kv_cache import KVCache
from radixserve.weights.loader import load_checkpoint, load_weights, resolve_model_path

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ModelRunner:
    """The Runner protocol over a real model (radixserve.engine.runner_api).

    Attributes: num_pages, page_size (KV capacity), max_context_len (positions the model
    takes: config.context_length or the model's max_position_embeddings), vocab_size,
    eos_token_ids, model_config, model, kv (KVCache), backend, dtype.

    Memory: weights twice on CPU (plain + oneDNN-packed, see layers/linear.py), the KV cache
    (config), and the default backend's DecodeMirror of decoding sequences (at most 2 GiB).

    For tests, construct from a folder: `ModelRunner.from_config(EngineConfig(model_path=dir,
    page_size=16, max_total_tokens=4096))`, then `run(ScheduledBatch([...]))` with page ids
    in [0, num_pages).
    """

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 backend: AttentionBackend | None = None):
        """`model`: loaded weights, not yet prepared. Allocates the KV cache from `config`."""
        self.config = config
        self.model_config = model_config
        self.dtype = DTYPES[config.dtype]
        self.page_size = config.page_size
        self.max_context_len = config.context_length or model_config.max_position_embeddings
        if self.max_context_len > model_config.max_position_embeddings:
            raise ValueError(f"context_length {self.max_context_len} exceeds the model's "
                             f"{model_config.max_position_embeddings} positions")
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self.model = model
        self.model.prepare(self.dtype)
        self.model.eval()
        self.num_pages = self._num_pages(config, model_config)
        self.kv = KVCache(model_config.num_layers, self.num_pages, self.page_size,
                          model_config.num_kv_heads, model_config.head_dim, self.dtype)
        self.backend = backend or TorchAttentionBackend()
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids)

    @classmethod
    def from_config(cls, config: EngineConfig) -> ModelRunner:
        """Resolve config.model_path (None: the embedded default GGUF), read its ModelConfig and
        weights, and allocate the KV cache. Sets torch's thread count from config.num_threads."""
        torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        path = resolve_model_path(config.model_path)
        start = time.perf_counter()
        model_config, weights = load_checkpoint(path)
        model = model_class(model_config)(model_config)
        load_weights(model, weights)
        runner = cls(model, model_config, config)
        logger.info("loaded %s (%s, %d layers) in %.1f s; KV: %d pages x %d tokens", path,
                    model_config.architecture, model_config.num_layers,
                    time.perf_counter() - start, runner.num_pages, runner.page_size)
        return runner

    @staticmethod
    def _num_pages(config: EngineConfig, mc: ModelConfig) -> int:
        if config.max_total_tokens is not None:
            return config.max_total_tokens // config.page_size
        per_token = KVCache.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, DTYPES[config.dtype])
        num_pages = int(config.kv_cache_memory_gb * 2**30) // (per_token * config.page_size)
        if num_pages < 2:
            raise ValueError(f"kv_cache_memory_gb={config.kv_cache_memory_gb} holds fewer than two pages")
        return num_pages

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        """One forward pass over every sequence of the step, then sampling and logprobs.
        Results follow batch.seqs order."""
        if not batch.seqs:
            return RunnerOutput([])
        step = build_step(batch, self.page_size, self.dtype)
        attn = self.backend.begin_step(self.kv, step)
        logits = self.model(step.input_ids, step.positions, attn, step.logit_rows)   # (R, V) fp32
        sample_idx = [r for r in step.sample_rows if r is not None]
        sampled: list[TokenLogprob] = []
        if sample_idx:
            rows = [s for s, r in zip(batch.seqs, step.sample_rows) if r is not None]
            picked = logits if len(sample_idx) == logits.shape[0] else logits[sample_idx]
            sampled = self.sampler.sample(picked, rows)
        results = []
        it = iter(sampled)
        for seq, sample_row, prompt in zip(batch.seqs, step.sample_rows, step.prompt_rows):
            token = next(it) if sample_row is not None else None
            prompt_lps = None
            if prompt is not None:
                first, targets = prompt
                rows = logits[first:first + len(targets)]
                k = seq.params.prompt_logprobs or 0
                prompt_lps = (token_logprobs(rows, torch.tensor(targets), k)
                              if targets else [])
            results.append(SeqResult(seq.request_id, token, prompt_lps))
        return RunnerOutput(results)
