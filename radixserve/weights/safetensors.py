"""Read an HF model directory: config.json and *.safetensors tensors, lazily one at a time."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from safetensors import safe_open

if TYPE_CHECKING:
    import torch


def read_hf_config(folder: str) -> dict:
    """config.json (FileNotFoundError if absent; ValueError naming the file if it is not a JSON object), eos_token_id
    widened to a list with generation_config.json's ids."""
    cfg = _json_object(os.path.join(folder, "config.json"))
    gen_path = os.path.join(folder, "generation_config.json")
    if os.path.exists(gen_path):
        gen_eos = _json_object(gen_path).get("eos_token_id")
        eos = cfg.get("eos_token_id")
        ids = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        ids += [e for e in (gen_eos if isinstance(gen_eos, list) else [gen_eos]) if e is not None and e not in ids]
        cfg["eos_token_id"] = ids
    return cfg


def _json_object(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        try:
            value = json.load(f)
        except ValueError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: a JSON object of settings expected, not {type(value).__name__}")
    return value


def safetensors_files(folder: str) -> list[str]:
    """Sorted *.safetensors paths in `folder`; ValueError when there are none."""
    files = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder}")
    return files


def iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor in its stored dtype) for every tensor, one materialised at a time."""
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
