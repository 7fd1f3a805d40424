"""The NextN / MTP draft layer of glm4_moe checkpoints (GLM-4.5/4.6/4.7): checkpoint layer `num_hidden_layers`.

One step (DeepSeek-V3's multi-token prediction module; transformers' MtpLayer):
    h' = eh_proj(cat[enorm(embed(next token)), hnorm(h)]) -> decoder block (MoE) -> shared_head.norm
    logits = lm_head(h')
h is the target's hidden state after its final norm (the LM head's input) for the first step, and the previous
step's h' after that. Embeddings and LM head are the target's unless the checkpoint gives the layer its own."""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from radixserve.layers.attention import Attention
from radixserve.layers.embedding import VocabEmbedding
from radixserve.layers.linear import Linear
from radixserve.layers.norm import RMSNorm
from radixserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, prepare_modules
from radixserve.weights.loader import load_weights

logger = logging.getLogger(__name__)
NEXTN_FAMILIES = ("glm4_moe",)
# Extra tensors of the NextN layer next to the decoder block's own (checkpoint names under model.layers.N.).
OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
SHARED = {"embed_tokens.weight": "embed", "shared_head.head.weight": "head"}


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
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = Linear(2 * c.hidden_size, c.hidden_size)
        self.shared_head = SharedHead(c.hidden_size, c.rms_norm_eps)
        # The target's, not registered here (not loaded or prepared again); _share_or_keep may replace them.
        self.parts = {"embed": target.model.embed_tokens, "head": target.lm_head, "rotary": target.rotary}
        self.sources: dict[str, str] = {}

    def draft(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              attn: Attention) -> torch.Tensor:
        """input_ids, positions (T,) int64 (the token after each hidden row, at that row's position);
        hidden (T, hidden_size) -> h' (T, hidden_size) after shared_head.norm."""
        rotary = self.parts["rotary"]
        cos, sin = rotary.cos_sin(positions)
        x = self.eh_proj(torch.cat([self.enorm(self.parts["embed"](input_ids)), self.hnorm(hidden)], dim=-1))
        return self.shared_head.norm(super().forward(x, cos, sin, rotary, attn))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, hidden_size) -> (R, vocab_size) fp32."""
        return self.parts["head"](hidden).float()


def nextn_tensors(weights: Iterable[tuple[str, torch.Tensor]], num_layers: int,
                  sink: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` less the NextN layer's tensors (`model.layers.{num_layers}.*`), which go to `sink`."""
    prefix = f"model.layers.{num_layers}."
    for name, tensor in weights:
        if name.startswith(prefix):
            sink.append((name, tensor))
        else:
            yield name, tensor


def load_nextn(target: LlamaForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> NextNLayer:
    """The NextN layer from the checkpoint tensors named `model.layers.{num_layers}.*` (`tensors`: those,
    full names). Raises ValueError for a family without one, a checkpoint without one, a missing, unknown
    or misshapen tensor (never a layer left at its initial weights: C53)."""
    c = target.config
    if c.architecture not in NEXTN_FAMILIES:
        raise ValueError(f"--speculative-algorithm EAGLE/NEXTN drafts with a checkpoint's NextN (MTP) layer; "
                         f"{c.architecture!r} has none here (supported: {', '.join(NEXTN_FAMILIES)})")
    prefix = f"model.layers.{c.num_layers}."
    layer = NextNLayer(target)
    own: list[tuple[str, torch.Tensor]] = []
    shared: list[tuple[str, torch.Tensor]] = []
    for name, tensor in tensors:
        short = name.removeprefix(prefix)
        if short in SHARED:
            shared.append((name, tensor))
        else:
            own.append((short, target.checkpoint_tensor(name, tensor)))
    if not own:
        raise ValueError(f"the checkpoint has no NextN (MTP) layer: no tensor named {prefix}* "
                         f"(--speculative-algorithm EAGLE needs one)")
    missing = [n for n in OWN if n not in {s for s, _ in own}]
    if missing:
        raise ValueError(f"the checkpoint's NextN layer lacks {', '.join(prefix + n for n in missing)}")
    try:
        load_weights(layer, own)
    except ValueError as e:
        raise ValueError(f"NextN layer {prefix}*: {e}") from None
    for name, tensor in shared:
        _share_or_keep(layer, SHARED[name.removeprefix(prefix)], tensor, name)
    for part in ("embed", "head"):
        layer.sources.setdefault(part, "the target's " + ("embed_tokens" if part == "embed" else "lm_head"))
    layer.sources["layer"] = f"{prefix}* ({len(own)} tensors)"
    logger.info("NextN draft: %s", "; ".join(f"{k} from {v}" for k, v in layer.sources.items()))
    return layer


def _share_or_keep(layer: NextNLayer, part: str, tensor: torch.Tensor, name: str) -> None:
    """The layer's own embeddings or head: shared with the target's when equal, else kept as its own."""
    current = layer.parts[part].weight
    if tuple(tensor.shape) != tuple(current.shape):
        raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)} "
                         f"vs the target's {tuple(current.shape)}")
    if torch.equal(tensor.to(current.dtype), current.data):
        layer.sources[part] = f"{name} (equal to the target's, shared)"
        return
    own = Linear(tensor.shape[1], tensor.shape[0]) if part == "head" else VocabEmbedding(*tensor.shape)
    own.weight.data.copy_(tensor)
    setattr(layer, "own_" + part, own)     # registered: prepared with the layer
    layer.parts[part] = own
    layer.sources[part] = f"{name} (its own)"


def prepare_nextn(layer: NextNLayer, dtype: torch.dtype, device: torch.device,
                  batch_invariant: bool = False) -> None:
    """After loading: the layer's own modules to `dtype` on `device` with their fast paths (the target's
    embeddings, head and rotary it shares are prepared with the target)."""
    prepare_modules(layer, dtype, device, batch_invariant)
