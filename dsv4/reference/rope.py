"""Rotary position embedding as DeepSeek-V4 uses it.

RoPE touches only the LAST `rope_head_dim` dims of a vector and rotates interleaved pairs
(dims 2i and 2i+1 of that slice share frequency i). Window-only layers use plain RoPE with
`rope_theta`; compressed layers (CSA and HCA, including the indexer) use `compress_rope_theta`
with YaRN frequency interpolation. V4 applies no YaRN attention (mscale) factor.
"""

from __future__ import annotations

import math

import torch

from dsv4.config import WINDOW, ModelConfig, YarnScaling

from .ops import accumulation_dtype


def rope_inv_freq(rope_dim: int, theta: float, yarn: YarnScaling | None = None) -> torch.Tensor:
    """Inverse frequency per rotated pair, float64 [rope_dim // 2]."""
    base = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    if yarn is None:
        return base
    # YaRN: pairs that turn fewer than `beta_slow` times over the original context are
    # interpolated (frequency / factor), pairs turning more than `beta_fast` times are kept, with a
    # linear ramp between. The ramp ends are whole pair indices (floor / ceil, i.e. "truncate").
    low = max(math.floor(_pair_turning(yarn.beta_fast, rope_dim, theta, yarn.original_max_position_embeddings)), 0)
    high = min(math.ceil(_pair_turning(yarn.beta_slow, rope_dim, theta, yarn.original_max_position_embeddings)),
               rope_dim - 1)
    if low == high:
        high += 0.001  # keep the ramp's slope finite
    pair = torch.arange(rope_dim // 2, dtype=torch.float64)
    interpolated_share = ((pair - low) / (high - low)).clamp(0, 1)
    return base * (1 - interpolated_share) + (base / yarn.factor) * interpolated_share


def _pair_turning(rotations: float, rope_dim: int, theta: float, context: int) -> float:
    """The (fractional) pair index whose wavelength fits `rotations` times into `context` tokens."""
    return rope_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def layer_inv_freq(cfg: ModelConfig, layer: int) -> torch.Tensor:
    """The frequencies of one layer: plain for window layers, YaRN'd for compressed ones."""
    if cfg.layer_kind(layer) == WINDOW:
        return rope_inv_freq(cfg.rope_head_dim, cfg.rope_theta)
    return rope_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2*len(inv_freq) dims of x [..., T, D] by the angles of `positions` [T].

    The token axis is -2 (heads, if any, go before it). `inverse` rotates backwards, which undoes
    RoPE on attention outputs. Computed in at least fp32; returns x's dtype.
    """
    acc = accumulation_dtype(x.dtype)
    rope_dim = 2 * inv_freq.numel()
    angles = positions.to(acc).unsqueeze(-1) * inv_freq.to(positions.device, acc)  # [T, rope_dim / 2]
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    even, odd = x[..., -rope_dim:].to(acc).unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rotated.to(x.dtype)], dim=-1)
