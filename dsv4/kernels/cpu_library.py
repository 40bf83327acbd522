"""The CPU path's C kernels on AVX512-BF16 (every file in cpu/: the attention's, cpu_attention.py; the
MoE's and its routing, cpu_moe.py; the decode steps' projections, cpu_project.py; the mHC mix,
cpu_mhc.py; the compressors' feed, cpu_compressor.py), built into one library with the system's C
compiler once per machine into the cache (well under a second; logged), under a key of their sources
and flags. Where the CPU lacks AVX512-BF16 or no compiler builds them, `available()` is False and the
model computes in torch ops.
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

_SOURCES = tuple(sorted((Path(__file__).with_name("cpu")).glob("*.c")))
_HEADERS = tuple(sorted((Path(__file__).with_name("cpu")).glob("*.h")))
_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-shared", "-fPIC", "-fopenmp")
BUILD_TIMEOUT_S = 120
_POINTER, _PARAMS = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)
# Each entry's arguments: its tensors' data pointers, the shapes and strides (int64[]), a float or two, the
# threads
_SIGNATURES = {
    "decode_attention": [_POINTER] * 11 + [_PARAMS, ctypes.c_float, ctypes.c_int],
    "moe_few": [_POINTER] * 11 + [_PARAMS, ctypes.c_float, ctypes.c_int],
    "moe_tiles": [_POINTER] * 11 + [_PARAMS, ctypes.c_float, ctypes.c_int],
    "moe_dots": [_POINTER] * 11 + [_PARAMS, ctypes.c_float, ctypes.c_int],
    "moe_route": [_POINTER] * 9 + [_PARAMS, ctypes.c_float, ctypes.c_int],
    "moe_routed": [_POINTER] * 9 + [_PARAMS, _PARAMS, ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int],
    "band_attention": [_POINTER] * 7 + [_PARAMS, ctypes.c_float, ctypes.c_int],
    "band_attention_dots": [_POINTER] * 7 + [_PARAMS, ctypes.c_float, ctypes.c_int],
    "mhc_mix": [_POINTER] * 12 + [_PARAMS, ctypes.c_float, ctypes.c_float, ctypes.c_int],
    "decode_project": [_POINTER] * 11 + [_PARAMS, ctypes.c_float, ctypes.c_int],
    "decode_exit": [_POINTER] * 6 + [_PARAMS, ctypes.c_int],
    "norm_rope": [_POINTER] * 4 + [_PARAMS, ctypes.c_float, ctypes.c_int],
    "decode_index_queries": [_POINTER] * 5 + [_PARAMS, ctypes.c_int],
    "decode_logits": [_POINTER] * 3 + [_PARAMS, ctypes.c_int],
    "compressor_store": [_POINTER] * 7 + [_PARAMS, ctypes.c_float, ctypes.c_int],
    "compressor_feed": [_POINTER] * 11 + [_PARAMS],
    "decode_layer": [_POINTER] * 3 + [ctypes.c_int, ctypes.c_int],
    "decode_layers": [ctypes.c_int64] + [_POINTER] * 4 + [ctypes.c_int],
    "decode_layer_scratch": [_PARAMS],
    "amx_ready": [],
}
_RESULTS = {"decode_layer_scratch": ctypes.c_int64}  # (the others return a status)


def as_read(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`tensor` contiguous (and of `dtype`) as a kernel reads it: itself where it already is. Two attribute
    reads, where `.to(dtype).contiguous()` dispatches two ops even when they change nothing (the C
    kernels' wrappers make ~50 such conversions in a decode step)."""
    if (dtype is None or tensor.dtype == dtype) and tensor.is_contiguous():
        return tensor
    return (tensor if dtype is None else tensor.to(dtype)).contiguous()


def available() -> bool:
    """Whether the kernels run here: the CPU has AVX512-BF16 and they are built (the first call builds
    them, or loads them from the cache)."""
    return _library() is not None


def entry(name: str):
    """The kernel `name` (returns 0, or non-zero where it could not allocate its scratch memory)."""
    library = _library()
    if library is None:
        raise RuntimeError("the AVX512-BF16 CPU kernels are not available on this machine")
    return getattr(library, name)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernels, built (or found in the cache) on the first call; None where this CPU lacks
    AVX512-BF16 or the build fails (logged)."""
    if not cpu_has_avx512_bf16():
        return None
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("cpu kernels: no C compiler (gcc or cc) to build the AVX512-BF16 kernels; the model runs "
                    "torch ops instead")
        return None
    key = hashlib.sha256(b"".join(source.read_bytes() for source in _SOURCES + _HEADERS)
                         + repr((_FLAGS, compiler)).encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"cpu_kernels-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.so")
        started = time.monotonic()
        try:
            subprocess.run([compiler, *_FLAGS, *map(str, _SOURCES), "-o", str(partial), "-lm"], check=True,
                           capture_output=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as e:
            detail = e.stderr.decode(errors="replace")[-2000:] if getattr(e, "stderr", None) else str(e)
            log.warning("cpu kernels: building the AVX512-BF16 kernels failed; the model runs torch ops instead: %s",
                        detail)
            partial.unlink(missing_ok=True)
            return None
        os.replace(partial, path)  # whole or absent: a concurrent start never loads half a library
        log.info("cpu kernels: built the AVX512-BF16 kernels in %.1f s", time.monotonic() - started)
    library = ctypes.CDLL(str(path))  # (ctypes releases the GIL for each call)
    log.info("cpu kernels: the AVX512-BF16 kernels are loaded (%s)", path)
    for name, arguments in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = arguments, _RESULTS.get(name, ctypes.c_int)
    return library
