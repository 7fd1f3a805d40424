"""FP8 KV scales per (layer, KV head): from the checkpoint, from a scales file, or calibrated at start-up -- never silently 1.0.

First found: checkpoint tensors model.layers.N.self_attn.k_scale / v_scale (vLLM's names); `--quantization-param-path`
JSON {"k_scale": [...], "v_scale": [...]}, per layer a number or per-head list; HEADROOM * max|x| / fp8_max calibrated."""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = 512
HEADROOM = 2.0
_SCALE_NAME = re.compile(r"layers\.(\d+)\..*\b([kv])_scale$")


@dataclass(frozen=True)
class KVScales:
    """k, v: (num_layers, num_kv_heads) fp32 on the CPU; source: "checkpoint", "file" or "calibration"."""

    k: torch.Tensor
    v: torch.Tensor
    source: str

    def describe(self) -> dict:
        return {"source": self.source,
                "k_scale": [round(x, 6) for x in self.k.amax(dim=1).tolist()],
                "v_scale": [round(x, 6) for x in self.v.amax(dim=1).tolist()]}


def from_checkpoint(tensors: dict[str, torch.Tensor], num_layers: int, num_kv_heads: int) -> KVScales | None:
    """None without tensors; ValueError for an unplaceable name or shape, or scales on only some layers."""
    if not tensors:
        return None
    k, v = torch.full((num_layers, num_kv_heads), float("nan")), torch.full((num_layers, num_kv_heads), float("nan"))
    for name, tensor in tensors.items():
        match = _SCALE_NAME.search(name)
        if match is None or int(match.group(1)) >= num_layers or tensor.numel() not in (1, num_kv_heads):
            raise ValueError(f"checkpoint KV scale {name} {tuple(tensor.shape)}: expected "
                             f"model.layers.N.*.k_scale / v_scale with N < {num_layers}, a scalar "
                             f"or {num_kv_heads} values (one per KV head)")
        layer, kind = int(match.group(1)), match.group(2)
        (k if kind == "k" else v)[layer] = tensor.float().reshape(-1).expand(num_kv_heads)
    return _checked(k, v, "checkpoint")


def from_file(path: str, num_layers: int, num_kv_heads: int) -> KVScales:
    """Scales from a JSON file (module docstring). Raises ValueError on a malformed file."""
    with open(path) as f:
        data = json.load(f)
    tensors = []
    for key in ("k_scale", "v_scale"):
        rows = data.get(key) if isinstance(data, dict) else None
        if not isinstance(rows, list) or len(rows) != num_layers:
            raise ValueError(f"{path}: {key!r} must list one entry per layer ({num_layers})")
        tensors.append(torch.tensor([[float(r)] * num_kv_heads if not isinstance(r, list) else
                                     [float(x) for x in r] for r in rows]))
        if tensors[-1].shape != (num_layers, num_kv_heads):
            raise ValueError(f"{path}: {key!r} per-head lists must have {num_kv_heads} entries")
    return _checked(tensors[0], tensors[1], "file")


def _checked(k: torch.Tensor, v: torch.Tensor, source: str) -> KVScales:
    for name, t in (("k_scale", k), ("v_scale", v)):
        if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
            raise ValueError(f"KV {name} from the {source} must be finite and positive for every "
                             f"layer and head, got {t.tolist()}")
    return KVScales(k, v, source)


class _Recorder:
    """Attention that records K/V amax per layer; to DSA models (SparseAttention) it offers no segment, so their
    indexer skips and every layer attends densely: the scales come from dense attention."""

    def __init__(self, num_layers: int, num_kv_heads: int):
        self.k_amax = torch.zeros(num_layers, num_kv_heads)
        self.v_amax = torch.zeros(num_layers, num_kv_heads)
        self.segments: list = []
        self.shared_selection = None

    def write_index_keys(self, layer_id: int, keys: torch.Tensor) -> None:
        pass

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k_amax[layer_id] = k.abs().float().amax(dim=(0, 2)).cpu()
        self.v_amax[layer_id] = v.abs().float().amax(dim=(0, 2)).cpu()
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(q.shape[0], -1)


@torch.inference_mode()
def calibrate(model: torch.nn.Module, num_layers: int, num_kv_heads: int, vocab_size: int,
              max_positions: int, fp8_dtype: torch.dtype, device: torch.device) -> KVScales:
    n = min(CALIBRATION_TOKENS, max_positions)
    ids = torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(0)).to(device)
    recorder = _Recorder(num_layers, num_kv_heads)
    model(ids, torch.arange(n, device=device), recorder, torch.tensor([n - 1], device=device))
    fp8_max = torch.finfo(fp8_dtype).max
    tiny = torch.finfo(torch.float32).tiny
    k = (recorder.k_amax * HEADROOM / fp8_max).clamp_(min=tiny)
    v = (recorder.v_amax * HEADROOM / fp8_max).clamp_(min=tiny)
    return _checked(k, v, "calibration")
