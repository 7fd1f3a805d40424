"""The generic Llama-family decoder: RMSNorm, RoPE, GQA or MLA attention (models/mla.py), SwiGLU MLP, fused QKV, gate-up.

Qwen2, Qwen3, GLM-4, GLM-4-0414, GLM-4.5, GLM-4.7-Flash and Qwen3-MoE are ModelConfig flags, not copies; attention over the paged
KV cache is the `Attention` the runner passes in (layers/attention.py), so models never import the runner."""
from __future__ import annotations

import torch

from radixserve.layers import row_path
from radixserve.layers.activation import silu_and_mul
from radixserve.layers.attention import Attention
from radixserve.layers.embedding import VocabEmbedding
from radixserve.layers.linear import GateUpLinear, Linear, QKVLinear
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import RotaryEmbedding, rope_inv_freq
from radixserve.models.mla import MLAAttention, rope_rows
from radixserve.models.model_config import ModelConfig
from radixserve.models.moe import Experts, MoE, Router


# A quantized model's LM head screens up to this many rows in int8, HEAD_EXACT_TOP logits exact (layers/screened_head.py).
HEAD_SCREEN_MAX_ROWS = 4
HEAD_EXACT_TOP = 64


class LlamaAttention(torch.nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.qkv_proj = QKVLinear(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.qkv_bias)
        self.o_proj = Linear(c.q_size, c.hidden_size, c.o_bias)
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
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        width = intermediate_size or config.intermediate_size
        self.gate_up_proj = GateUpLinear(config.hidden_size, width, config.mlp_bias)
        self.down_proj = Linear(width, config.hidden_size, config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden); gate_up's output stays in its computed dtype (bf16 for quantized layers)."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(x, cast_back=False)))


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MLAAttention(c, layer_id) if c.mla else LlamaAttention(c, layer_id)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.moe is not None and layer_id not in c.moe.dense_layers:
            shared = (LlamaMLP(c, c.moe.intermediate_size * c.moe.num_shared_experts)
                      if c.moe.num_shared_experts else None)
            self.mlp: torch.nn.Module = MoE(c.hidden_size, c.moe, shared)
        else:
            self.mlp = LlamaMLP(c)
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
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(torch.nn.Module):
    """Parameter names are transformers' with q/k/v and gate/up fused (`model.layers.0.self_attn.qkv_proj.weight`)."""

    # checkpoint name part -> (our fused module name part, shard)
    FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
             "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        if config.mla is not None:   # MLA's q_proj (no q LoRA) is a plain projection
            self.FUSED = {name: target for name, target in self.FUSED.items() if target[0] != "qkv_proj"}
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens.weight)
        s = config.rope_scaling
        inv_freq = rope_inv_freq(config.rot_dim, config.rope_theta,
                                 s.rope_type if s else None, s.factor if s else 1.0,
                                 s.low_freq_factor if s else 1.0, s.high_freq_factor if s else 4.0,
                                 (s.original_max_position_embeddings or config.max_position_embeddings)
                                 if s else None)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, inv_freq,
                                      rotary_dim=config.rot_dim)

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as stored here: with interleaved RoPE (GLM-4) q/k rotary rows reorder from pairs
        (2i, 2i+1) to (i, i + rot/2) for the rotate-half kernel (q.k is unchanged: q and k permute alike)."""
        c = self.config
        if c.mla is not None:
            return rope_rows(c, name, tensor)
        if not c.rope_interleaved or not (".q_proj." in name or ".k_proj." in name):
            return tensor
        rot = c.rot_dim
        order = torch.cat([torch.arange(0, rot, 2), torch.arange(1, rot, 2), torch.arange(rot, c.head_dim)])
        heads = tensor.shape[0] // c.head_dim
        return tensor.reshape(heads, c.head_dim, -1)[:, order].reshape(tensor.shape)

    def prepare(self, dtype: torch.dtype, device: torch.device | str = "cpu",
                batch_invariant: bool = False, quantized_max_tokens: int = 0) -> None:
        """After loading: move to `device` and `dtype` (routers stay fp32), build the layers' fast paths or batch-invariant
        form (ValueError where it cannot be built), screen a quantized model's head, time the single-row path."""
        routers = [m for m in self.modules() if isinstance(m, Router)]
        kept = [[p.data.float() for p in r.parameters()] for r in routers]
        self.to(device=device, dtype=dtype)
        for router, params in zip(routers, kept):
            for param, data in zip(router.parameters(), params):
                param.data = data.to(device)
        self.rotary.cos_cache = self.rotary.cos_cache.to(device=device, dtype=dtype)
        self.rotary.sin_cache = self.rotary.sin_cache.to(device=device, dtype=dtype)
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepare(batch_invariant, quantized_max_tokens)
            elif isinstance(module, (Router, Experts)):
                module.prepare(batch_invariant)
        if any(isinstance(m, Linear) and m.quantized for m in self.modules()):
            self.lm_head.enable_screened_head(HEAD_SCREEN_MAX_ROWS, HEAD_EXACT_TOP)
        row_path.choose([m for m in self.modules() if isinstance(m, Linear)])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention,
                logit_rows: torch.Tensor | None = None, num_layers: int | None = None) -> torch.Tensor:
        """input_ids, positions (T,) int64; logit_rows (R,) int64 (None: all) -> logits (R, vocab_size) fp32.
        `num_layers`: run only the first that many decoder layers (a self-draft, runner/draft.py)."""
        cos, sin = self.rotary.cos_sin(positions)
        residual = self.model.embed_tokens(input_ids)
        for layer in self.model.layers[:num_layers]:
            residual = layer(residual, cos, sin, self.rotary, attn)
        if logit_rows is not None:
            residual = residual.index_select(0, logit_rows)
        return self.lm_head(self.model.norm(residual)).float()
