"""The generic Llama-family decoder: RMSNorm, RoPE, GQA attention, SwiGLU MLP, fused QKV and gate-up.

Attention over the paged KV cache is not done here: each layer hands q, k, v to the
`Attention` the runner passes in (layers/attention.py), so models never import the runner.
"""
from __future__ import annotations

import torch

from radixserve.layers.activation import silu_and_mul
from radixserve.layers.attention import Attention
from radixserve.layers.embedding import VocabEmbedding
from radixserve.layers.linear import GateUpLinear, Linear, QKVLinear
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import RotaryEmbedding, rope_inv_freq
from radixserve.models.model_config import ModelConfig


class LlamaAttention(torch.nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.qkv_proj = QKVLinear(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.qkv_bias)
        self.o_proj = Linear(c.q_size, c.hidden_size, c.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary: RotaryEmbedding, attn: Attention) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        num_tokens = x.shape[0]
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)                                          # (T, (H + 2KV) * D)
        # q and k rotate together in one pass: (T, H + KV, D).
        qk = rotary.apply(qkv[:, :(h + kv) * d].view(num_tokens, h + kv, d), cos, sin)
        v = qkv[:, (h + kv) * d:].view(num_tokens, kv, d)
        out = attn(self.layer_id, qk[:, :h], qk[:, h:], v)               # (T, H * D)
        return self.o_proj(out)


class LlamaMLP(torch.nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = GateUpLinear(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary: RotaryEmbedding, attn: Attention) -> torch.Tensor:
        """residual: (T, hidden), updated in place and returned."""
        residual.add_(self.self_attn(self.input_layernorm(residual), cos, sin, rotary, attn))
        residual.add_(self.mlp(self.post_attention_layernorm(residual)))
        return residual


class LlamaModel(torch.nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(torch.nn.Module):
    """Parameter names follow transformers' (`model.layers.0.self_attn.qkv_proj.weight`, ...),
    with q/k/v and gate/up fused; `FUSED` tells the weight loader where checkpoint names go."""

    # checkpoint name part -> (our fused module name part, shard)
    FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
             "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.qk_norm:
            raise NotImplementedError("q/k norm (Qwen3) is not implemented yet")
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens.weight)
        s = config.rope_scaling
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta,
                                 s.rope_type if s else None, s.factor if s else 1.0,
                                 s.low_freq_factor if s else 1.0, s.high_freq_factor if s else 4.0,
                                 (s.original_max_position_embeddings or config.max_position_embeddings)
                                 if s else None)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, inv_freq)

    def prepare(self, dtype: torch.dtype, device: torch.device | str = "cpu",
                batch_invariant: bool = False) -> None:
        """After loading: move to `device` in the compute dtype, rebuild the RoPE tables in it,
        and build the linear layers' fast paths (CPU only), or their batch-invariant form
        (layers/batch_invariant.py; raises ValueError where it cannot be built)."""
        self.to(device=device, dtype=dtype)
        self.rotary.cos_cache = self.rotary.cos_cache.to(device=device, dtype=dtype)
        self.rotary.sin_cache = self.rotary.sin_cache.to(device=device, dtype=dtype)
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepare(batch_invariant)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention,
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: (T,) int64; logit_rows: (R,) int64 token rows whose logits
        are wanted (None: all). Returns logits (R, vocab_size) fp32."""
        cos, sin = self.rotary.cos_sin(positions)                        # (T, 1, D) each, once per step
        residual = self.model.embed_tokens(input_ids)                    # (T, hidden)
        for layer in self.model.layers:
            residual = layer(residual, cos, sin, self.rotary, attn)
        if logit_rows is not None:
            residual = residual.index_select(0, logit_rows)
        return self.lm_head(self.model.norm(residual)).float()
