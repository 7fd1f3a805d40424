"""Find a checkpoint, read its ModelConfig, and load its tensors into a model by name (shared by HF and GGUF)."""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Iterator

import torch

from radixserve.layers.quant_linear import MATMULS
from radixserve.models.model_config import ModelConfig
from radixserve.weights.gguf import load_gguf
from radixserve.weights.paths import is_gguf
from radixserve.weights.safetensors import iter_safetensors, read_hf_config

logger = logging.getLogger(__name__)
# Checkpoint tensors no model parameter corresponds to.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# FP8 KV cache scales (FP8 checkpoints): handed back to the runner, not loaded into the model.
KV_SCALE_SUFFIXES = ("k_scale", "v_scale")
# One routed expert's projection: `<layer>.mlp.experts.<e>.<gate|up|down>_proj.weight`.
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


def resolve_quantization(quantization: str, path: str, deterministic: bool = False) -> str:
    """--quantization as served for the checkpoint at `path`: "none", "int4" or "int8".

    auto: int4 for a GGUF file (its Q4_0 / Q4_1 / Q4_K linear weights run on the int4 kernel,
    the rest stays fp32), none for an HF folder and under deterministic inference (the
    quantized kernels are not proven batch-invariant; logged). Raises ValueError for int4 or
    int8 on an HF folder (only GGUF weights are read quantized).
    """
    if quantization == "auto":
        if deterministic and is_gguf(path):
            logger.info("--quantization auto: serving unquantized, because the int4 kernel is not "
                        "proven batch-invariant for --enable-deterministic-inference")
        return "int4" if is_gguf(path) and not deterministic else "none"
    if quantization != "none" and not is_gguf(path):
        raise ValueError(f"--quantization {quantization} reads GGUF blocks; {path!r} is not a .gguf file")
    return quantization


def load_checkpoint(path: str, quantization: str = "none") -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """ModelConfig plus a lazy iterator of (transformers parameter name, tensor) for an HF
    directory (config.json + *.safetensors) or a .gguf file. `quantization`: "none", or for a
    GGUF "int4" / "int8" (see `resolve_quantization`): then some tensors are quantized weights."""
    if is_gguf(path):
        return load_gguf(path, quantization)
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is neither an HF model directory nor a .gguf file")
    return ModelConfig.from_hf(read_hf_config(path)), iter_safetensors(path)


def load_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Copy checkpoint tensors (transformers names) into `model`'s parameters.

    Each tensor first passes `model.checkpoint_tensor(name, tensor)` when the model has one
    (layout changes such as GLM's interleaved RoPE rows). Names whose module part appears in
    `model.FUSED` (e.g. `q_proj` -> (`qkv_proj`, "q")) go into that shard of the fused layer via
    its `load(tensor, shard, is_bias)`; a checkpoint that stores the fused tensor itself (GLM's
    `gate_up_proj`) fills every shard. Routed experts (`...experts.{e}.{proj}.weight`) go to the
    stacked experts module's `load_expert`. A tied LM head ignores `lm_head.weight`; multi-token
    prediction layers (`model.layers.{num_layers}.*`, GLM-4.5) are skipped. Raises ValueError for unknown names, shape mismatches and
    parameters the checkpoint never filled. Returns the KV cache scale tensors (names ending
    in `k_scale` / `v_scale`) by name, for the runner's FP8 KV cache. A quantized checkpoint
    weight (quant_linear.py's Int4Weight / Int8Weight, from a GGUF with --quantization) goes to
    its Linear's `load`.
    """
    fused: dict[str, tuple[str, str]] = getattr(model, "FUSED", {})
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=True))
    config = getattr(model, "config", None)
    tied = getattr(config, "tie_word_embeddings", False)
    mtp_prefix = f"model.layers.{config.num_layers}." if hasattr(config, "num_layers") else None
    transform = getattr(model, "checkpoint_tensor", lambda _, t: t)
    loaded: set[str] = set()
    kv_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if (name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight")
                or (mtp_prefix and name.startswith(mtp_prefix))):
            continue
        if name.endswith(KV_SCALE_SUFFIXES):
            kv_scales[name] = tensor
            continue
        quantized = isinstance(tensor, tuple(MATMULS))
        if quantized:   # quantized rows move as a whole (codes with their scales)
            rows = torch.arange(tensor.shape[0]).unsqueeze(1)
            order = transform(name, rows)
            tensor = tensor if order is rows else tensor.take_rows(order.squeeze(1))
        else:
            tensor = transform(name, tensor)
        expert = _EXPERT.match(name)
        if expert and hasattr(modules.get(expert[1]), "load_expert"):
            modules[expert[1]].load_expert(int(expert[2]), expert[3], tensor)
            loaded.add(f"{expert[1]}:{expert[2]}.{expert[3]}")
            continue
        module_name, _, kind = name.rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        if leaf in fused:
            target, shard = fused[leaf]
            module = modules.get(f"{parent}.{target}")
            if module is None:
                raise ValueError(f"checkpoint tensor {name} has no matching fused module")
            module.load(tensor, shard, is_bias=kind == "bias")
            loaded.add(f"{parent}.{target}.{kind}:{shard}")
            continue
        if name not in params:
            raise ValueError(f"checkpoint tensor {name} matches no model parameter")
        if tuple(params[name].shape) != tuple(tensor.shape):
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)} "
                             f"vs model {tuple(params[name].shape)}")
        if quantized:
            modules[module_name].load(tensor)
        else:
            params[name].data.copy_(tensor)
        loaded.add(name)
        loaded.update(f"{name}:{shard}" for shard in getattr(modules.get(module_name), "shards", ()))
    missing = [n for n in _expected(model, modules, params, fused) if n not in loaded]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:5]}")
    return kv_scales


def _expected(model: torch.nn.Module, modules: dict[str, torch.nn.Module],
              params: dict[str, torch.nn.Parameter], fused: dict[str, tuple[str, str]]) -> list[str]:
    """Every name `load_weights` must see: plain parameters, each shard of fused ones, and
    each expert projection of stacked experts."""
    shards_of: dict[str, list[str]] = {}
    for target, shard in fused.values():
        shards_of.setdefault(target, []).append(shard)
    names: list[str] = []
    stacked: set[str] = set()
    for name in params:
        module_name, _, kind = name.rpartition(".")
        module = modules.get(module_name)
        if hasattr(module, "checkpoint_names"):      # stacked experts: one entry per expert tensor
            if module_name not in stacked:
                stacked.add(module_name)
                names += [f"{module_name}:{n}" for n in module.checkpoint_names()]
            continue
        leaf = module_name.rpartition(".")[2]
        if leaf in shards_of:
            names += [f"{name}:{s}" for s in shards_of[leaf]]
        else:
            names.append(name)
    return names
