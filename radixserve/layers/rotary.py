"""RoPE (Su et al. 2021) in the rotate-half layout; linear, llama3 and YaRN scaling; partial rotary (GLM)."""
from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, rope_type: str | None = None, factor: float = 1.0,
                  low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                  original_max_position: int | None = None) -> torch.Tensor:
    """(head_dim // 2,) fp32, as transformers' rope init functions compute them, so angles are bit-identical."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        old_len = original_max_position
        low_wavelen, high_wavelen = old_len / low_freq_factor, old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    assert rope_type is None, f"unknown rope type {rope_type!r}"
    return inv_freq


def yarn_inv_freq(head_dim: int, theta: float, factor: float, original_max_position: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True) -> torch.Tensor:
    """(head_dim // 2,) fp32 YaRN frequencies ("NTK-by-parts", arXiv 2309.00071 section 3.2): dims that turn more than
    beta_fast times over the original context keep theta^(-2i/d) (extrapolation), those turning fewer than beta_slow
    times take it / factor (interpolation), a linear ramp between; `truncate` floors / ceils the ramp's ends, in
    transformers' `_compute_yarn_parameters` arithmetic order (bit-identical angles)."""
    def dim_of(rotations: float) -> float:
        return head_dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001   # a one-point ramp would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolate = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


class RotaryEmbedding(torch.nn.Module):
    """cos / signed-sin tables for [0, max_position); with rotary_dim < head_dim only the first rotary_dim dims rotate.
    `scale` multiplies the rotated dims' cos and sin (YaRN's attention factor; 1.0 otherwise)."""

    def __init__(self, head_dim: int, max_position: int, inv_freq: torch.Tensor,
                 dtype: torch.dtype = torch.float32, rotary_dim: int | None = None, scale: float = 1.0):
        super().__init__()
        rot = rotary_dim or head_dim
        assert inv_freq.shape[0] * 2 == rot, "inv_freq must have rotary_dim / 2 entries"
        pos = torch.arange(max_position, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        half = rot // 2
        sin = emb.sin() * scale
        sin[:, :half] = -sin[:, :half]
        cos = emb.cos() * scale
        if rot < head_dim:
            cos = torch.cat([cos, torch.ones(max_position, head_dim - rot)], dim=-1)
            sin = torch.cat([sin, torch.zeros(max_position, head_dim - rot)], dim=-1)
        self.register_buffer("cos_cache", cos.to(dtype), persistent=False)
        self.register_buffer("sin_cache", sin.to(dtype), persistent=False)
        self.half = half
        perm = torch.cat([torch.arange(half, rot), torch.arange(half), torch.arange(rot, head_dim)])
        self.register_buffer("partner", perm if rot < head_dim else None, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) int64 -> cos, sin: (T, 1, D) in the model dtype (broadcast over heads)."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (T, heads, D), any strides -> x * cos + rotate_half(x) * sin, contiguous; the minus sign is in the sin table."""
        if self.partner is not None:
            return torch.addcmul(x * cos, x.index_select(-1, self.partner), sin)
        return torch.addcmul(x * cos, torch.roll(x, self.half, dims=-1), sin)
