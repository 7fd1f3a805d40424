"""DeepSeek sparse attention (DSA; DeepSeek-V3.2, GLM-5): MLA (models/mla.py) whose queries attend only to the top-k
positions a lightning indexer picks, as transformers 5.25's GlmMoeDsaAttention / GlmMoeDsaIndexer compute it.

Per full layer and token the indexer stores one key in the KV cache's side buffer; IndexShare ("shared") layers reuse
the last full layer's choice; a step with every context <= index_topk runs as plain MLA (docs/mla.md, DSA)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.layers.attention import Segment, SparseAttention
from radixserve.layers.linear import Linear
from radixserve.layers.parallel import Collectives
from radixserve.layers.rotary import RotaryEmbedding
from radixserve.models.mla import MLAAttention
from radixserve.models.model_config import ModelConfig

# transformers' indexer k_norm is a LayerNorm with its class eps.
INDEX_NORM_EPS = 1e-6
# Index scores are computed in row blocks of at most this many fp32 values (rows x heads x context).
SCORE_BLOCK_VALUES = 1 << 24


class FP32Weight(torch.nn.Module):
    """A bias-free projection whose (out, in) weight stays fp32 in a bf16 model (transformers keeps weights_proj fp32;
    LlamaForCausalLM.prepare leaves modules with `keep_fp32` alone)."""

    keep_fp32 = True

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, in) any dtype -> (T, out) fp32."""
        return F.linear(x.float(), self.weight)


def select_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, start_pos: int, topk: int,
                stride: int = 1) -> torch.Tensor:
    """The lightning indexer's choice for n query rows at start_pos + stride * j over keys of positions [0, ctx): per
    row the min(topk, ctx) largest I[t, s] = sum_h weights[t, h] * relu(q[t, h] . keys[s] * Di^-0.5), s <= t.

    q (n, Hi, Di), weights (n, Hi) fp32 (already x Hi^-0.5), keys (ctx, Di); computed in fp32. Returns (n, K) int64
    positions, -1 where fewer than K positions are causal (transformers selects masked ones there, then masks them)."""
    n, heads, dim = q.shape
    ctx = keys.shape[0]
    k = min(topk, ctx)
    keys = keys.float()
    out = torch.empty(n, k, dtype=torch.long, device=q.device)
    block = max(1, SCORE_BLOCK_VALUES // (heads * ctx))
    key_pos = torch.arange(ctx, device=q.device)
    for a in range(0, n, block):
        b = min(a + block, n)
        scores = torch.matmul(q[a:b].float(), keys.T).mul_(dim ** -0.5).relu_()            # (rows, Hi, ctx)
        index = torch.matmul(weights[a:b].unsqueeze(1), scores).squeeze(1)                 # (rows, ctx)
        pos = start_pos + stride * torch.arange(a, b, device=q.device)[:, None]
        index.masked_fill_(key_pos[None, :] > pos, float("-inf"))
        chosen = index.topk(k, dim=-1).indices
        out[a:b] = chosen.masked_fill_(chosen > pos, -1)
    return out


def selection_rows(segments: list[Segment], topk: int) -> list[int | None] | None:
    """Per segment the rows of its Indexer selection, (rows, topk) int64, or None where it would select every causal
    position (context_len <= topk); None for a step where every segment is such."""
    if all(s.context_len <= topk for s in segments):
        return None
    return [None if s.context_len <= topk else s.row_end - s.row_start for s in segments]


class Indexer(torch.nn.Module):
    """transformers' GlmMoeDsaIndexer: q = wq_b(q_resid) (Hi, Di), k = LayerNorm(wk(x)) (Di,), both rotated on their
    first qk_rope_head_dim dims (de-interleaved at load, index_rope_rows), head weights = weights_proj(x) * Hi^-0.5 in
    fp32. Forward writes every token's key and returns select_topk per segment, None where selection_rows says."""

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        d, m = config.dsa, config.mla
        self.layer_id, self.topk, self.rope = layer_id, d.index_topk, m.qk_rope_head_dim
        self.num_heads, self.head_dim = d.index_n_heads, d.index_head_dim
        self.wq_b = Linear(m.q_lora_rank, d.index_n_heads * d.index_head_dim)
        self.wk = Linear(config.hidden_size, d.index_head_dim)
        self.k_norm = torch.nn.LayerNorm(d.index_head_dim, eps=INDEX_NORM_EPS)
        self.k_norm.requires_grad_(False)
        self.weights_proj = FP32Weight(d.index_n_heads, config.hidden_size)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        """x (T, heads, Di): RoPE on the first `rope` dims, the rest passed through."""
        return torch.cat([rotary.apply(x[..., :self.rope], cos, sin), x[..., self.rope:]], dim=-1)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary: RotaryEmbedding, attn: SparseAttention) -> list[torch.Tensor | None] | None:
        keys = self._rotate(self.k_norm(self.wk(x)).unsqueeze(1), cos, sin, rotary).squeeze(1)     # (T, Di)
        attn.write_index_keys(self.layer_id, keys)
        rows = selection_rows(attn.segments, self.topk)
        if rows is None:
            return None
        q = self._rotate(self.wq_b(q_resid).view(-1, self.num_heads, self.head_dim), cos, sin, rotary)
        weights = self.weights_proj(x) * self.num_heads ** -0.5                                   # (T, Hi)
        return [select_topk(q[s.row_start:s.row_end], weights[s.row_start:s.row_end],
                            attn.index_keys(self.layer_id, i), s.start_pos, self.topk, s.stride)
                if n is not None else None
                for i, (s, n) in enumerate(zip(attn.segments, rows))]


class DSAAttention(MLAAttention):
    """transformers' GlmMoeDsaAttention: a full layer (config.dsa.full_layers) runs its Indexer, a shared one reuses
    attn.shared_selection; a dense step (selection None) attends through the plain MLA path. Under TP `tp` the heads
    split as MLA's; the Indexer is replicated: every rank gets the same top-k from the same (all-reduced) input."""

    def __init__(self, config: ModelConfig, layer_id: int, tp: Collectives | None = None):
        super().__init__(config, layer_id, tp)
        if config.mla.q_lora_rank is None:
            raise ValueError("glm_moe_dsa needs q_lora_rank (the indexer reads the q LoRA residual)")
        self.indexer = Indexer(config, layer_id) if layer_id in config.dsa.full_layers else None

    def attend(self, attn: SparseAttention, q: torch.Tensor, k: torch.Tensor, x: torch.Tensor,
               q_resid: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
               rotary: RotaryEmbedding) -> torch.Tensor:
        if self.indexer is not None:
            attn.shared_selection = self.indexer(x, q_resid, cos, sin, rotary, attn)
        selection = attn.shared_selection
        if selection is None:
            return attn(self.layer_id, q, k, k)
        return attn.attend_selected(self.layer_id, q, k, selection)


def index_rope_rows(config: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """An indexer checkpoint tensor with the rope rows of each key (wk, k_norm) or query head (wq_b) de-interleaved,
    (2i, 2i+1) -> (i, rope/2 + i): transformers' interleaved rotation equals rotate-half on rows so ordered, and the
    LayerNorm between wk and the rotation commutes with a row permutation applied to its weight and bias too."""
    if (not config.dsa.index_rope_interleaved or ".indexer." not in name
            or not any(part in name for part in (".wq_b.", ".wk.", ".k_norm."))):
        return tensor
    rope, width = config.mla.qk_rope_head_dim, config.dsa.index_head_dim
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2), torch.arange(rope, width)])
    return tensor.reshape(tensor.shape[0] // width, width, -1)[:, order].reshape(tensor.shape)
