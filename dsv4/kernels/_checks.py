"""Argument checks shared by the kernel launchers and their torch paths.

Both paths of an op run the same checks, so a call that works on CPU works on GPU and a bad call
fails the same way on both: with a ValueError naming the argument, before anything is launched.
Only metadata is checked (shapes, dtypes, strides, devices): checking values would synchronise
with the GPU.
"""

from __future__ import annotations

import torch

from .row_codec import row_alignment, row_bytes

INDEX_DTYPES = (torch.int32, torch.int64)


def fail(op: str, message: str) -> None:
    raise ValueError(f"{op}: {message}")


def check_tensor(op: str, name: str, t, *, dims: int, dtypes: tuple[torch.dtype, ...],
                 shape: tuple[int | None, ...] | None = None) -> None:
    """`t` is a tensor of `dims` dims, one of `dtypes`, matching `shape` where it gives a size."""
    if not isinstance(t, torch.Tensor):
        fail(op, f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != dims:
        fail(op, f"{name} must have {dims} dims, got shape {list(t.shape)}")
    if t.dtype not in dtypes:
        fail(op, f"{name} must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, t.shape, strict=True)):
            if want is not None and want != got:
                fail(op, f"{name} has size {got} on dim {axis}, expected {want} (shape {list(t.shape)})")


def check_rows(op: str, name: str, t, *, row_format: str, dim: int, rope_dim: int, dims: int = 3) -> None:
    """`t` holds packed rows: uint8, last dim the row's bytes (contiguous), rows aligned for their
    widest element (the kernels read bf16 and fp32 fields straight out of the bytes)."""
    want = row_bytes(row_format, dim, rope_dim)
    check_tensor(op, name, t, dims=dims, dtypes=(torch.uint8,), shape=(None,) * (dims - 1) + (want,))
    if t.stride(-1) != 1:
        fail(op, f"{name}: the bytes of a row must be contiguous (last stride {t.stride(-1)})")
    align = row_alignment(row_format)
    if t.data_ptr() % align or any(s % align for s in t.stride()[:-1]):
        fail(op, f"{name}: rows of format {row_format!r} must start on {align}-byte boundaries "
                 f"(strides {t.stride()})")


def check_same_device(op: str, **tensors) -> torch.device:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        fail(op, f"tensors are on different devices: {', '.join(f'{k}={v}' for k, v in devices.items())}")
    return first


def check_format(op: str, row_format: str, allowed: tuple[str, ...]) -> None:
    if row_format not in allowed:
        fail(op, f"row format {row_format!r} is not one of {allowed}")
