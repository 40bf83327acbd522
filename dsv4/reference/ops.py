"""Elementwise and normalisation helpers shared by every reference module."""

from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision for sensitive math (norms, softmaxes, mHC, routing): at least float32."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim in at least fp32 (optionally times `weight`); returns x's dtype."""
    acc = accumulation_dtype(x.dtype)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(acc)
    return y.to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x @ weight.T in the weight's dtype (weights are stored [out, in], like the checkpoint)."""
    return x.to(weight.dtype) @ weight.T
