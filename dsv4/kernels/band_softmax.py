"""The softmax weights of the CPU path's banded sink attention (dsv4.model.attention.banded_sink_attention)
for bf16-valued operands, as one C kernel on AVX512-BF16 (cpu/band_softmax.c): the logits' products
on the CPU's bf16 units, summed in fp32 (exact products: the same sums as fp32 arithmetic, in another
order), then scaled, masked, exponentiated against each row's peak and summed, a tile of rows at a
time while it is in cache. Its oracle is the model's torch code for the same weights (the attention's
tests run both against dsv4.reference).

The kernel is built with the system's C compiler once per machine into the cache (a second or two;
logged), under a key of its source and flags. Where the CPU lacks AVX512-BF16 or no compiler builds
it, `available()` is False and the attention computes in fp32 torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

from dsv4.config import cache_dir
from dsv4.config.server_args import cpu_has_avx512_bf16

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu") / "band_softmax.c"
_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-shared", "-fPIC", "-fopenmp")
BUILD_TIMEOUT_S = 120


def available() -> bool:
    """Whether the kernel runs here: the CPU has AVX512-BF16 and the kernel is built (the first call
    builds it, or loads it from the cache)."""
    return _kernel() is not None


def band_softmax(q: torch.Tensor, raw: torch.Tensor, raw_allowed: torch.Tensor, sink: torch.Tensor,
                 compressed: torch.Tensor | None = None, compressed_allowed: torch.Tensor | None = None, *,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """q [B, N, Q, H, D] over raw [B, N, K, D] (raw_allowed [B, N, Q, K] bool) and compressed [B, C, D]
    (compressed_allowed [B, N, Q, C]), all fp32 holding bf16 values, sink [H] -> the unnormalised
    softmax weights exp(logit - peak) [B, N, Q, H, K] and [B, N, Q, H, C] (None without compressed
    rows), and each row's denominator [B, N, Q, H, 1] (the sink's term included), in fp32. A logit is
    scale * q.k; masked keys weigh 0; a row's peak is its largest logit or the head's sink."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the AVX512-BF16 band softmax kernel is not available on this machine")
    batch, blocks, block, heads, dim = q.shape
    keys = raw.shape[2]
    count = 0 if compressed is None else compressed.shape[1]
    _check(q, raw, raw_allowed, sink, compressed, compressed_allowed)
    raw_weights = q.new_empty(batch, blocks, block, heads, keys)
    compressed_weights = q.new_empty(batch, blocks, block, heads, count) if count else None
    denominator = q.new_empty(batch, blocks, block, heads, 1)
    raw_mask = raw_allowed.view(torch.uint8)
    comp_mask = compressed_allowed.view(torch.uint8) if count else None
    params = (batch, blocks, block, heads, keys, count, dim,
              q.stride(0), q.stride(1), q.stride(3),
              raw.stride(0), raw.stride(1), raw.stride(2),
              raw_mask.stride(0), raw_mask.stride(1), raw_mask.stride(2),
              *((compressed.stride(0), compressed.stride(1)) if count else (0, 0)),
              *((comp_mask.stride(0), comp_mask.stride(1), comp_mask.stride(2)) if count else (0, 0, 0)))
    sink = sink.float().contiguous()
    status = kernel(q.data_ptr(), raw.data_ptr(), raw_mask.data_ptr(), compressed.data_ptr() if count else None,
                    comp_mask.data_ptr() if count else None, sink.data_ptr(), raw_weights.data_ptr(),
                    compressed_weights.data_ptr() if count else None, denominator.data_ptr(),
                    (ctypes.c_int64 * len(params))(*params), scale, torch.get_num_threads())
    if status != 0:
        raise MemoryError("band_softmax: the kernel could not allocate its scratch memory")
    return raw_weights, compressed_weights, denominator


def _check(q, raw, raw_allowed, sink, compressed, compressed_allowed) -> None:
    """The layouts the kernel reads (strides in elements; every innermost one 1)."""
    batch, blocks, block, heads, dim = q.shape
    keys = raw.shape[2]
    problems = []
    if q.dtype != torch.float32 or raw.dtype != torch.float32:
        problems.append(f"q and raw must be fp32 (got {q.dtype}, {raw.dtype})")
    if q.device.type != "cpu":
        problems.append(f"the kernel runs on CPU tensors (got {q.device})")
    if q.stride(4) != 1 or q.stride(3) != dim or q.stride(2) != heads * dim:
        problems.append(f"q's (query, head, dim) rows must be contiguous (strides {q.stride()})")
    if raw.shape[:2] != (batch, blocks) or raw.shape[3] != dim or raw.stride(3) != 1:
        problems.append(f"raw must be [B, N, K, {dim}] with contiguous rows (got {tuple(raw.shape)}, {raw.stride()})")
    if raw_allowed.shape != (batch, blocks, block, keys) or raw_allowed.dtype != torch.bool or raw_allowed.stride(3) != 1:
        problems.append(f"raw_allowed must be bool [B, N, Q, K] with contiguous rows (got {tuple(raw_allowed.shape)})")
    if sink.shape != (heads,):
        problems.append(f"sink must be [{heads}] (got {tuple(sink.shape)})")
    if compressed is not None and compressed.shape[1]:
        count = compressed.shape[1]
        if compressed.dtype != torch.float32 or compressed.shape != (batch, count, dim) or compressed.stride(2) != 1:
            problems.append(f"compressed must be fp32 [B, C, {dim}] with contiguous rows (got {tuple(compressed.shape)})")
        if (compressed_allowed is None or compressed_allowed.shape != (batch, blocks, block, count)
                or compressed_allowed.dtype != torch.bool or compressed_allowed.stride(3) != 1):
            problems.append("compressed_allowed must be bool [B, N, Q, C] with contiguous rows")
    if problems:
        raise RuntimeError("band_softmax: " + "; ".join(problems))


@functools.cache
def _kernel():
    """The kernel's entry point, built (or found in the cache) on the first call; None where this
    CPU lacks AVX512-BF16 or the build fails (logged)."""
    if not cpu_has_avx512_bf16():
        return None
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("band_softmax: no C compiler (gcc or cc) to build the AVX512-BF16 kernel; "
                    "the attention's logits run in fp32")
        return None
    key = hashlib.sha256(_SOURCE.read_bytes() + repr((_FLAGS, compiler)).encode()).hexdigest()[:16]
    library = cache_dir() / "kernels" / f"band_softmax-{key}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        partial = library.with_name(f"{library.stem}.{os.getpid()}.partial.so")
        started = time.monotonic()
        try:
            subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(partial)], check=True, capture_output=True,
                           timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as e:
            detail = e.stderr.decode(errors="replace")[-2000:] if getattr(e, "stderr", None) else str(e)
            log.warning("band_softmax: building the AVX512-BF16 kernel failed; the attention's logits run in "
                        "fp32: %s", detail)
            partial.unlink(missing_ok=True)
            return None
        os.replace(partial, library)  # whole or absent: a concurrent start never loads half a library
        log.info("band_softmax: built the AVX512-BF16 kernel in %.1f s (%s)", time.monotonic() - started, library)
    entry = ctypes.CDLL(str(library)).band_softmax  # (ctypes releases the GIL for the call)
    entry.argtypes = [ctypes.c_void_p] * 9 + [ctypes.POINTER(ctypes.c_int64), ctypes.c_float, ctypes.c_int]
    entry.restype = ctypes.c_int
    return entry
