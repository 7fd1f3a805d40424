"""The NextN / MTP draft layer of glm4_moe (GLM-4.5/4.6/4.7), glm_moe_dsa (GLM-5), deepseek_v32: layer N = num_layers.

One step (DeepSeek-V3's multi-token prediction module; transformers' MtpLayer):
    h' = eh_proj(cat[enorm(embed(next token)), hnorm(h)]) -> decoder block (MoE) -> shared_head.norm
    logits = lm_head(h')
h: the target's hidden state after its final norm for the first step, the previous step's h' after that. Embeddings
and LM head are the target's unless the checkpoint has the layer's own. DSA models: its own full indexer (layer N)."""
from __future__ import annotations

import torch

from radixserve.layers.attention import Attention
from radixserve.layers.linear import Linear
from radixserve.layers.norm import RMSNorm
from radixserve.models.dsa import Indexer
from radixserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, prepare_modules


class SharedHead(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class NextNLayer(LlamaDecoderLayer):
    """The decoder block of layer N (its attention writes KV layer N) plus enorm, hnorm, eh_proj and
    shared_head.norm; parameter names are the checkpoint's below `model.layers.N.`."""

    FUSED = LlamaForCausalLM.FUSED

    def __init__(self, target: LlamaForCausalLM):
        c = target.config
        super().__init__(c, c.num_layers)
        if c.dsa is not None and self.self_attn.indexer is None:   # N is past config.dsa.full_layers
            self.self_attn.indexer = Indexer(c, c.num_layers)
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = Linear(2 * c.hidden_size, c.hidden_size)
        self.shared_head = SharedHead(c.hidden_size, c.rms_norm_eps)
        # The target's, not registered here (not loaded or prepared again); _share_or_keep may replace them.
        self.parts = {"embed": target.model.embed_tokens, "head": target.lm_head, "rotary": target.rotary}
        self.sources: dict[str, str] = {}
        self.token_map: torch.Tensor | None = None    # (K,) int64 vocabulary ids of the draft head's rows

    def draft(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              attn: Attention) -> torch.Tensor:
        """input_ids, positions (T,) int64 (the token after each hidden row, at that row's position);
        hidden (T, hidden_size) -> h' (T, hidden_size) after shared_head.norm."""
        rotary = self.parts["rotary"]
        cos, sin = rotary.cos_sin(positions)
        x = self.eh_proj(torch.cat([self.enorm(self.parts["embed"](input_ids)), self.hnorm(hidden)], dim=-1))
        return self.shared_head.norm(super().forward(x, cos, sin, rotary, attn))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, hidden_size) -> (R, vocab_size) fp32, or (R, K) over the token map's rows."""
        return self.parts["head"](hidden).float()

    def propose(self, hidden: torch.Tensor, min_prob: float = 0.0) -> list[int | None]:
        """(R, hidden_size) -> R greedy draft token ids (through the token map if any); None where the draft's
        probability of its token is below `min_prob` (the softmax is computed only when min_prob > 0)."""
        logits = self.logits(hidden)
        best = logits.argmax(-1)
        ids = (best if self.token_map is None else self.token_map[best]).tolist()
        if min_prob <= 0:
            return ids
        probs = torch.softmax(logits, dim=-1).gather(1, best.unsqueeze(1)).squeeze(1).tolist()
        return [token if prob >= min_prob else None for token, prob in zip(ids, probs)]

    def reduce_vocab(self, token_map: torch.Tensor) -> None:
        """Score only the head rows `token_map` ((K,) int64, distinct ids < vocab_size): a head of its own holding
        those rows of the current one (called at load time, before prepare). Raises ValueError on bad ids."""
        head = self.parts["head"]
        if token_map.dim() != 1 or token_map.numel() == 0 or token_map.dtype != torch.int64:
            raise ValueError(f"token_map must be a non-empty 1-D int64 tensor, got {tuple(token_map.shape)} "
                             f"{token_map.dtype}")
        if int(token_map.min()) < 0 or int(token_map.max()) >= head.out_features \
                or token_map.unique().numel() != token_map.numel():
            raise ValueError(f"token_map must hold distinct ids in [0, {head.out_features})")
        own = Linear(head.in_features, token_map.numel())
        own.weight.data.copy_(head.weight_rows(token_map))
        self.own_head = own          # registered: prepared with the layer
        self.parts["head"] = own
        self.token_map = token_map.clone()
        self.sources["head"] = f"{token_map.numel()} rows of {self.sources.get('head', 'the target head')}"


def prepare_nextn(layer: NextNLayer, dtype: torch.dtype, device: torch.device,
                  batch_invariant: bool = False) -> None:
    """After loading: the layer's own modules to `dtype` on `device`, fast paths built (shared parts: the target's)."""
    prepare_modules(layer, dtype, device, batch_invariant)
