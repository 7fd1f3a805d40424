"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434) in the absorbed form, over the paged KV cache.

Per token the cache holds one head [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]. kv_b_proj's key part folds into
the query (q_nope @ W_UK) and its value part applies after attention (W_UV @ sum p * c_kv), so every step, prefill
and decode alike, is MQA over that one head with V = K: the backend needs no MLA code (docs/mla.md)."""
from __future__ import annotations

import torch

from radixserve.layers.attention import Attention
from radixserve.layers.linear import Linear
from radixserve.layers.norm import RMSNorm
from radixserve.layers.parallel import Collectives, TPSplit, column_split, row_linear, shard_heads
from radixserve.layers.rotary import RotaryEmbedding
from radixserve.models.model_config import ModelConfig

# transformers' q_a_layernorm and kv_a_layernorm keep their class default eps, not rms_norm_eps.
LORA_NORM_EPS = 1e-6


class Weight(torch.nn.Module):
    """A bare (out, in) weight read as a tensor, never called: kv_b_proj (its loader name stays `.weight`);
    `tp_split`: the rows of the checkpoint tensor this rank holds (None: all)."""

    def __init__(self, out_features: int, in_features: int, tp_split: TPSplit | None = None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.tp_split = tp_split

    def local_part(self, tensor: torch.Tensor, shard: str | None = None, is_bias: bool = False) -> torch.Tensor:
        return tensor if self.tp_split is None else self.tp_split.local(tensor, shard, is_bias)


class MLAAttention(torch.nn.Module):
    """transformers' DeepseekV3Attention / Glm4MoeLiteAttention; rope rows arrive de-interleaved (rope_rows).

    Under TP `tp` (docs/parallel.md, MLA): this rank's H / size query heads (q_proj or q_b_proj and kv_b_proj by head
    rows, o_proj row-parallel, all-reduced); replicated: the LoRA down-projections, their norms and the latent head."""

    def __init__(self, config: ModelConfig, layer_id: int, tp: Collectives | None = None):
        super().__init__()
        c, m = config, config.mla
        heads = shard_heads(c.num_heads, 1, tp)      # one latent "head", replicated: no KV-head divisibility
        self.layer_id, self.num_heads = layer_id, heads.num_heads
        self.nope, self.rope, self.rank, self.v_dim = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank,
                                                       m.v_head_dim)
        q_width, kv_width = self.nope + self.rope, self.nope + self.v_dim
        q_rows = {None: (heads.q_start * q_width, heads.num_heads * q_width)}
        self.q_lora = m.q_lora_rank is not None
        if not self.q_lora:
            self.q_proj = column_split(Linear(c.hidden_size, q_rows[None][1]), q_rows, tp)
        else:
            self.q_a_proj = Linear(c.hidden_size, m.q_lora_rank, c.qkv_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = column_split(Linear(m.q_lora_rank, q_rows[None][1]), q_rows, tp)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, self.rank + self.rope, c.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LORA_NORM_EPS)
        kv_rows = (heads.q_start * kv_width, heads.num_heads * kv_width)
        self.kv_b_proj = Weight(kv_rows[1], self.rank,
                                TPSplit(0, {None: kv_rows}, tp.rank) if tp is not None and tp.size > 1 else None)
        self.o_proj = row_linear(c.num_heads * self.v_dim, c.hidden_size, c.o_bias, tp)
        # transformers' scale: (nope + rope)^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 (1.0 without YaRN).
        # The backend scales scores by D^-0.5 over the cache width D = rank + rope, so q carries the ratio.
        m = c.rope_scaling.softmax_mscale if c.rope_scaling else 1.0
        self.softmax_scale = (self.nope + self.rope) ** -0.5 * m * m    # transformers' order: equal to the bit
        self.q_scale = self.softmax_scale * (self.rank + self.rope) ** 0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary: RotaryEmbedding, attn: Attention) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden); cos, sin over the rope dims."""
        num_tokens, h = x.shape[0], self.num_heads
        q_resid = self.q_a_layernorm(self.q_a_proj(x)) if self.q_lora else None
        q = self.q_b_proj(q_resid) if self.q_lora else self.q_proj(x)
        q = q.view(num_tokens, h, self.nope + self.rope)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        w = self.kv_b_proj.weight.view(h, self.nope + self.v_dim, self.rank)
        q_lat = torch.bmm(q[..., :self.nope].transpose(0, 1), w[:, :self.nope])              # (H, T, rank)
        q_pe = rotary.apply(q[..., self.nope:], cos, sin)                                     # (T, H, rope)
        k = torch.cat([self.kv_a_layernorm(latent), rotary.apply(k_pe.unsqueeze(1), cos, sin).squeeze(1)], dim=-1)
        q = torch.cat([q_lat.transpose(0, 1), q_pe], dim=-1).mul_(self.q_scale)               # (T, H, rank + rope)
        k = k.unsqueeze(1)                                                                    # (T, 1, rank + rope)
        out = self.attend(attn, q, k, x, q_resid, cos, sin, rotary)
        out = out.view(num_tokens, h, -1)[..., :self.rank]                                    # (T, H, rank)
        out = torch.bmm(out.transpose(0, 1), w[:, self.nope:].transpose(1, 2))                # (H, T, v_dim)
        return self.o_proj(out.transpose(0, 1).reshape(num_tokens, h * self.v_dim))

    def attend(self, attn: Attention, q: torch.Tensor, k: torch.Tensor, x: torch.Tensor,
               q_resid: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
               rotary: RotaryEmbedding) -> torch.Tensor:
        """Latent attention: q (T, H, rank + rope), k (T, 1, rank + rope) -> (T, H * (rank + rope)); DSA overrides
        it (models/dsa.py) with x (T, hidden) and q_resid (T, q_lora_rank) for its indexer."""
        return attn(self.layer_id, q, k, k)


def rope_rows(config: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor with its rope rows de-interleaved, (2i, 2i+1) -> (i, i + rope/2), when rope_interleave:
    transformers' apply_rotary_pos_emb_interleave equals rotate-half on rows so ordered (q and k alike)."""
    m = config.mla
    if not config.rope_interleaved:
        return tensor
    if ".q_proj." in name or ".q_b_proj." in name:
        lead, width = m.qk_nope_head_dim, m.qk_nope_head_dim + m.qk_rope_head_dim
    elif ".kv_a_proj_with_mqa." in name:
        lead, width = m.kv_lora_rank, m.kv_lora_rank + m.qk_rope_head_dim
    else:
        return tensor
    rope = m.qk_rope_head_dim
    order = torch.cat([torch.arange(lead), lead + torch.arange(0, rope, 2), lead + torch.arange(1, rope, 2)])
    return tensor.reshape(tensor.shape[0] // width, width, -1)[:, order].reshape(tensor.shape)
