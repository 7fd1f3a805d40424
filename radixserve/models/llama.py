"""The generic Llama-family decoder: RMSNorm, RoPE, GQA or MLA attention (models/mla.py), SwiGLU MLP, fused QKV, gate-up.

Qwen2, Qwen3, GLM-4, GLM-4-0414, GLM-4.5, GLM-4.7-Flash and Qwen3-MoE are ModelConfig flags, not copies; attention over the paged
KV cache is the `Attention` the runner passes in (layers/attention.py), so models never import the runner."""
from __future__ import annotations

import torch

from radixserve.config_checks import check_experts_fit
from radixserve.layers import row_path
from radixserve.layers.activation import silu_and_mul
from radixserve.layers.attention import Attention
from radixserve.layers.embedding import VocabEmbedding
from radixserve.layers.linear import GateUpLinear, Linear, QKVLinear
from radixserve.layers.norm import RMSNorm
from radixserve.layers.parallel import (Collectives, ParallelLMHead, VocabParallelEmbedding, column_split,
                                        row_linear, shard_heads, split_even)
from radixserve.layers.rotary import RotaryEmbedding, rope_inv_freq, yarn_inv_freq
from radixserve.models.dsa import DSAAttention, index_rope_rows
from radixserve.models.mla import MLAAttention, rope_rows
from radixserve.models.model_config import ModelConfig
from radixserve.models.moe import Experts, MoE, Router


# A quantized model's LM head screens up to this many rows in int8, HEAD_EXACT_TOP logits exact (layers/screened_head.py),
# or, where its fp32 weight is a Q8_0 grid (a GGUF Q8_0 head), runs up to HEAD_Q8_MAX_ROWS rows on layers/q8_fp32.py.
HEAD_SCREEN_MAX_ROWS = 4
HEAD_EXACT_TOP = 64
HEAD_Q8_MAX_ROWS = 8


def prepare_modules(root: torch.nn.Module, dtype: torch.dtype, device: torch.device | str = "cpu",
                    batch_invariant: bool = False, quantized_max_tokens: int = 0) -> None:
    """Cast `root` to `dtype`, `device` (routers, keep_fp32 modules: fp32); build Linear/Router/Experts fast paths."""
    routers = [m for m in root.modules() if isinstance(m, Router) or getattr(m, "keep_fp32", False)]
    kept = [[p.data.float() for p in r.parameters()] for r in routers]
    root.to(device=device, dtype=dtype)
    for router, params in zip(routers, kept):
        for param, data in zip(router.parameters(), params):
            param.data = data.to(device)
    for module in root.modules():
        if isinstance(module, Linear):
            module.prepare(batch_invariant, quantized_max_tokens)
        elif isinstance(module, (Router, Experts)):
            module.prepare(batch_invariant)


def rotary_embedding(config: ModelConfig) -> RotaryEmbedding:
    """The model's RoPE tables from its rope_theta and rope_scaling (YaRN: its frequencies and cos / sin scale)."""
    s = config.rope_scaling
    original = (s.original_max_position_embeddings or config.max_position_embeddings) if s else None
    if s is not None and s.rope_type == "yarn":
        inv_freq = yarn_inv_freq(config.rot_dim, config.rope_theta, s.factor, original, s.beta_fast, s.beta_slow,
                                 s.truncate)
    else:
        inv_freq = rope_inv_freq(config.rot_dim, config.rope_theta, s.rope_type if s else None,
                                 s.factor if s else 1.0, s.low_freq_factor if s else 1.0,
                                 s.high_freq_factor if s else 4.0, original)
    return RotaryEmbedding(config.head_dim, config.max_position_embeddings, inv_freq, rotary_dim=config.rot_dim,
                           scale=s.cos_sin_scale if s else 1.0)


class LlamaAttention(torch.nn.Module):
    """Under tensor parallelism `tp`: this rank's heads (layers/parallel.py shard_heads), o_proj all-reduced."""

    def __init__(self, config: ModelConfig, layer_id: int, tp: Collectives | None = None):
        super().__init__()
        c, d = config, config.head_dim
        self.layer_id = layer_id
        heads = shard_heads(c.num_heads, c.num_kv_heads, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, d
        kv_rows = (heads.kv_start * d, heads.num_kv_heads * d)
        self.qkv_proj = column_split(
            QKVLinear(c.hidden_size, heads.num_heads, heads.num_kv_heads, d, c.qkv_bias),
            {"q": (heads.q_start * d, heads.num_heads * d), "k": kv_rows, "v": kv_rows}, tp)
        self.o_proj = row_linear(c.q_size, c.hidden_size, c.o_bias, tp)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary: RotaryEmbedding, attn: Attention) -> torch.Tensor:
        num_tokens = x.shape[0]
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        qk = qkv[:, :(h + kv) * d].view(num_tokens, h + kv, d)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])], dim=1)
        qk = rotary.apply(qk, cos, sin)
        v = qkv[:, (h + kv) * d:].view(num_tokens, kv, d)
        out = attn(self.layer_id, qk[:, :h], qk[:, h:], v)
        return self.o_proj(out)


class LlamaMLP(torch.nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None, tp: Collectives | None = None,
                 reduce: bool = True):
        super().__init__()
        width = intermediate_size or config.intermediate_size
        rows = split_even(width, tp) if tp is not None and tp.size > 1 else (0, width)
        self.gate_up_proj = column_split(GateUpLinear(config.hidden_size, rows[1], config.mlp_bias),
                                         {"gate": rows, "up": rows}, tp)
        self.down_proj = row_linear(width, config.hidden_size, config.mlp_bias, tp, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden); gate_up's output stays in its computed dtype (bf16 for quantized layers)."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(x, cast_back=False)))


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: Collectives | None = None, ep_size: int = 1):
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = (DSAAttention(c, layer_id, tp) if c.dsa else MLAAttention(c, layer_id, tp) if c.mla
                          else LlamaAttention(c, layer_id, tp))
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.moe is not None and layer_id not in c.moe.dense_layers:
            shared = (LlamaMLP(c, c.moe.intermediate_size * c.moe.num_shared_experts, tp, reduce=False)
                      if c.moe.num_shared_experts else None)
            self.mlp: torch.nn.Module = MoE(c.hidden_size, c.moe, shared, tp, ep_size)
        else:
            self.mlp = LlamaMLP(c, tp=tp)
        self.post_self_attn_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps) if c.post_norms else None
        self.post_mlp_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps) if c.post_norms else None

    def forward(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary: RotaryEmbedding, attn: Attention) -> torch.Tensor:
        """residual: (T, hidden), updated in place and returned."""
        out = self.self_attn(self.input_layernorm(residual), cos, sin, rotary, attn)
        residual.add_(out if self.post_self_attn_layernorm is None else self.post_self_attn_layernorm(out))
        out = self.mlp(self.post_attention_layernorm(residual))
        residual.add_(out if self.post_mlp_layernorm is None else self.post_mlp_layernorm(out))
        return residual


class LlamaModel(torch.nn.Module):
    def __init__(self, config: ModelConfig, tp: Collectives | None = None, ep_size: int = 1):
        super().__init__()
        parallel = tp is not None and tp.size > 1
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp) if parallel
                             else VocabEmbedding(config.vocab_size, config.hidden_size))
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(config, i, tp, ep_size)
                                         for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(torch.nn.Module):
    """Parameter names are transformers' with q/k/v and gate/up fused (`model.layers.0.self_attn.qkv_proj.weight`).
    `tp`: this rank's group under tensor parallelism; every rank then returns the same full logits. `ep_size`:
    expert-parallel ranks inside it (models/moe.py Experts); ValueError for a model without routed experts."""

    # checkpoint name part -> (our fused module name part, shard)
    FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
             "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}

    def __init__(self, config: ModelConfig, tp: Collectives | None = None, ep_size: int = 1):
        super().__init__()
        check_experts_fit(ep_size, config.moe.num_experts if config.moe else None, config.architecture)
        self.config = config
        if config.mla is not None:   # MLA's q_proj (no q LoRA) is a plain projection
            self.FUSED = {name: target for name, target in self.FUSED.items() if target[0] != "qkv_proj"}
        self.model = LlamaModel(config, tp, ep_size)
        # KV heads cached per rank (MLA: the one latent head, replicated)
        self.num_kv_heads = 1 if config.mla else shard_heads(config.num_heads, config.num_kv_heads, tp).num_kv_heads
        self.lm_head = (ParallelLMHead(config.hidden_size, config.vocab_size, tp) if tp is not None and tp.size > 1
                        else Linear(config.hidden_size, config.vocab_size))
        if config.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens.weight)
        self.rotary = rotary_embedding(config)

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as stored here: with interleaved RoPE (GLM-4) q/k rotary rows reorder from pairs
        (2i, 2i+1) to (i, i + rot/2) for the rotate-half kernel (q.k is unchanged: q and k permute alike)."""
        c = self.config
        if c.mla is not None:
            return index_rope_rows(c, name, rope_rows(c, name, tensor)) if c.dsa else rope_rows(c, name, tensor)
        if not c.rope_interleaved or not (".q_proj." in name or ".k_proj." in name):
            return tensor
        rot = c.rot_dim
        order = torch.cat([torch.arange(0, rot, 2), torch.arange(1, rot, 2), torch.arange(rot, c.head_dim)])
        heads = tensor.shape[0] // c.head_dim
        return tensor.reshape(heads, c.head_dim, -1)[:, order].reshape(tensor.shape)

    def prepare(self, dtype: torch.dtype, device: torch.device | str = "cpu",
                batch_invariant: bool = False, quantized_max_tokens: int = 0) -> None:
        """After loading: move to `device` and `dtype` (routers and keep_fp32 modules stay fp32), build the layers' fast paths or batch-invariant
        form (ValueError where it cannot be built), give a quantized model's head its small-step path (Q8_0 kernel, else the
        screen) unless batch-invariant, time the single-row path."""
        prepare_modules(self, dtype, device, batch_invariant, quantized_max_tokens)
        self.rotary.cos_cache = self.rotary.cos_cache.to(device=device, dtype=dtype)
        self.rotary.sin_cache = self.rotary.sin_cache.to(device=device, dtype=dtype)
        if not batch_invariant and any(isinstance(m, Linear) and m.quantized for m in self.modules()):
            if not self.lm_head.enable_q8_head(HEAD_Q8_MAX_ROWS):
                self.lm_head.enable_screened_head(HEAD_SCREEN_MAX_ROWS, HEAD_EXACT_TOP)
        row_path.choose([m for m in self.modules() if isinstance(m, Linear)])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention,
                logit_rows: torch.Tensor | None = None, num_layers: int | None = None) -> torch.Tensor:
        """input_ids, positions (T,) int64; logit_rows (R,) int64 (None: all) -> logits (R, vocab_size) fp32.
        `num_layers`: run only the first that many decoder layers (a self-draft, runner/draft.py)."""
        return self.head(self._decode_layers(input_ids, positions, attn, num_layers), logit_rows)

    def head(self, residual: torch.Tensor, logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """residual (T, hidden) -> logits (R, vocab_size) fp32 of `logit_rows` (R,) int64 (None: all rows)."""
        if logit_rows is not None:
            residual = residual.index_select(0, logit_rows)
        return self.lm_head(self.model.norm(residual)).float()

    def final_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention) -> torch.Tensor:
        """Every position's hidden state after the final norm (the LM head's input): (T, hidden_size),
        what an MTP draft reads (models/nextn.py); logits = lm_head(rows of it)."""
        return self.model.norm(self._decode_layers(input_ids, positions, attn, None))

    def _decode_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention,
                       num_layers: int | None) -> torch.Tensor:
        layers = range(len(self.model.layers))[:num_layers]
        return self.run_layers(self.embed(input_ids), positions, attn, layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (T,) int64 -> the residual stream's start (T, hidden)."""
        return self.model.embed_tokens(input_ids)

    def run_layers(self, residual: torch.Tensor, positions: torch.Tensor, attn: Attention,
                   layers: range) -> torch.Tensor:
        """residual (T, hidden) through decoder `layers` in place (a pp stage: its range); positions (T,) int64."""
        cos, sin = self.rotary.cos_sin(positions)
        for i in layers:
            residual = self.model.layers[i](residual, cos, sin, self.rotary, attn)
        return residual

    def keep_stage(self, layers: range, first: bool, last: bool) -> tuple[str, ...]:
        """Pipeline parallelism (runner/pp.py), before loading: keep decoder `layers` (attention renumbered from 0),
        the embedding on the `first` stage and the norm and LM head on the `last` (a tied head keeps the embedding);
        drop the rest. Returns the dropped checkpoint name prefixes (the loader skips them)."""
        dropped = [f"model.layers.{i}." for i in range(len(self.model.layers)) if i not in layers]
        for i in range(len(self.model.layers)):
            if i in layers:
                attn = self.model.layers[i].self_attn
                attn.layer_id = i - layers.start
                if getattr(attn, "indexer", None) is not None:
                    attn.indexer.layer_id = attn.layer_id
            else:
                self.model.layers[i] = torch.nn.Identity()
        tied = self.config.tie_word_embeddings
        if not first and not (last and tied):
            self.model.embed_tokens = None
            dropped.append("model.embed_tokens.")
        if not last:
            self.model.norm = self.lm_head = None
            dropped += ["model.norm.", "lm_head."]
        return tuple(dropped)
