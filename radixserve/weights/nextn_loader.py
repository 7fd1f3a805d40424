"""Load a checkpoint's NextN / MTP layer (`model.layers.{num_hidden_layers}.*`) into models/nextn.py's NextNLayer.

Every draft parameter comes from a named checkpoint tensor or is the target's (embeddings, LM head); a missing,
unknown or misshapen tensor is a load error, never a draft left at its initial weights (case C53). A trained head
file (load_draft_head) brings the same tensors for any Llama-shaped family."""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from radixserve.layers.embedding import VocabEmbedding
from radixserve.layers.linear import Linear
from radixserve.models.llama import LlamaForCausalLM
from radixserve.models.block_config import check_nextn_family
from radixserve.models.nextn import NextNLayer
from radixserve.weights.gguf_names import nextn_gguf_name
from radixserve.weights.loader import load_weights
from radixserve.weights.paths import is_gguf

logger = logging.getLogger(__name__)
# Extra tensors of the NextN layer next to the decoder block's own (checkpoint names under model.layers.N.).
OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
SHARED = {"embed_tokens.weight": "embed", "shared_head.head.weight": "head"}


def nextn_tensors(weights: Iterable[tuple[str, torch.Tensor]], num_layers: int,
                  sink: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` less the NextN layer's tensors (`model.layers.{num_layers}.*`), which go to `sink`."""
    prefix = f"model.layers.{num_layers}."
    for name, tensor in weights:
        if name.startswith(prefix):
            sink.append((name, tensor))
        else:
            yield name, tensor


def load_nextn(target: LlamaForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]],
               origin: str = "the checkpoint") -> NextNLayer:
    """The NextN layer from `tensors`, those named `model.layers.{num_layers}.*` of checkpoint `origin`. Raises
    ValueError (GGUF names too) for a family or checkpoint without one, a missing, unknown or misshapen tensor (C53)."""
    check_nextn_family(target.config.architecture)
    return _build(target, tensors, origin)


def load_draft_head(target: LlamaForCausalLM, path: str) -> NextNLayer:
    """A trained draft head file (training/train_draft_head.py writes one): safetensors with the NextN tensor
    names under `model.layers.{num_layers}.` and optionally `token_map` ((K,) int64, the draft vocabulary).
    Raises ValueError for an unreadable file, a tensor outside that prefix, or as load_nextn does."""
    try:
        tensors = load_file(path)
    except (OSError, SafetensorError) as e:
        raise ValueError(f"--speculative-draft-model-path {path!r}: not a readable safetensors file ({e})") from None
    token_map = tensors.pop("token_map", None)
    prefix = f"model.layers.{target.config.num_layers}."
    stray = sorted(name for name in tensors if not name.startswith(prefix))
    if stray:
        raise ValueError(f"draft head {path}: tensors outside {prefix}* ({', '.join(stray[:3])}): "
                         f"is it for a model with {target.config.num_layers} layers?")
    layer = _build(target, tensors.items(), path)
    if token_map is not None:
        layer.reduce_vocab(token_map)
    return layer


def _build(target: LlamaForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]], origin: str) -> NextNLayer:
    c = target.config
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
    gguf = is_gguf(origin)
    if not own:
        where = f"GGUF blk.{c.num_layers}.* (counted by nextn_predict_layers)" if gguf else f"named {prefix}*"
        raise ValueError(f"{origin} has no NextN (MTP) layer: no tensor {where} "
                         f"(--speculative-algorithm EAGLE needs one)")
    missing = [n for n in OWN if n not in {s for s, _ in own}]
    if missing:
        raise ValueError(f"{origin}'s NextN layer lacks " + ", ".join(
            prefix + n + (f" (GGUF {nextn_gguf_name(c.num_layers, n)})" if gguf else "") for n in missing))
    try:
        load_weights(layer, own)
    except ValueError as e:
        raise ValueError(f"NextN layer of {origin}, {prefix}*: {e}") from None
    for name, tensor in shared:
        _share_or_keep(layer, SHARED[name.removeprefix(prefix)], tensor, name)
    for part in ("embed", "head"):
        layer.sources.setdefault(part, "the target's " + ("embed_tokens" if part == "embed" else "lm_head"))
    layer.sources["layer"] = f"{prefix}* of {origin} ({len(own)} tensors)"
    logger.info("NextN draft: %s", "; ".join(f"{k} from {v}" for k, v in layer.sources.items()))
    return layer


def _share_or_keep(layer: NextNLayer, part: str, tensor: torch.Tensor, name: str) -> None:
    """The layer's own embeddings or head: shared with the target's when equal, else kept as its own."""
    module = layer.parts[part]
    current = module.weight
    if tuple(tensor.shape) != tuple(current.shape):
        raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)} "
                         f"vs the target's {tuple(current.shape)}")
    if isinstance(module, Linear) and module.holds_quantized:   # a GGUF head read as int4 / int8
        current = module.weight_rows(torch.arange(module.out_features))
    if torch.equal(tensor.to(current.dtype), current.data):
        layer.sources[part] = f"{name} (equal to the target's, shared)"
        return
    own = Linear(tensor.shape[1], tensor.shape[0]) if part == "head" else VocabEmbedding(*tensor.shape)
    own.weight.data.copy_(tensor)
    setattr(layer, "own_" + part, own)     # registered: prepared with the layer
    layer.parts[part] = own
    layer.sources[part] = f"{name} (its own)"
