"""Find a checkpoint, read its ModelConfig, and load its tensors into a model by name (shared by HF and GGUF)."""
from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator

import torch

from radixserve.layers.quant_linear import MATMULS
from radixserve.models.model_config import ModelConfig
from radixserve.weights.gguf import load_gguf
from radixserve.weights.paths import is_gguf
from radixserve.weights.safetensors import iter_safetensors, read_hf_config

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# FP8 KV cache scales: handed back to the runner, not loaded into the model.
KV_SCALE_SUFFIXES = ("k_scale", "v_scale")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


def load_checkpoint(path: str, quantization: str = "none") -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """ModelConfig and a lazy (transformers name, tensor or quantized weight) iterator for an HF folder or a .gguf file."""
    if is_gguf(path):
        return load_gguf(path, quantization)
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is neither an HF model directory nor a .gguf file")
    return ModelConfig.from_hf(read_hf_config(path)), iter_safetensors(path)


def load_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Copy checkpoint tensors into `model`, each through `model.checkpoint_tensor` when present: `model.FUSED` names
    into their shard, routed experts via `load_expert`, each cut to this rank's part by its module's `local_part`;
    a tied `lm_head.weight` and MTP layers are skipped. Raises ValueError for unknown names, shape mismatches and
    unfilled parameters. Returns the KV cache scales by name."""
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
        if quantized:
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
            module.load(module.local_part(tensor, shard, kind == "bias"), shard, is_bias=kind == "bias")
            loaded.add(f"{parent}.{target}.{kind}:{shard}")
            continue
        if name not in params:
            raise ValueError(f"checkpoint tensor {name} matches no model parameter")
        local_part = getattr(modules.get(module_name), "local_part", None)
        if local_part is not None:
            tensor = local_part(tensor, None, kind == "bias")
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
    shards_of: dict[str, list[str]] = {}
    for target, shard in fused.values():
        shards_of.setdefault(target, []).append(shard)
    names: list[str] = []
    stacked: set[str] = set()
    for name in params:
        module_name, _, kind = name.rpartition(".")
        module = modules.get(module_name)
        if hasattr(module, "checkpoint_names"):
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
