"""The CPU path's C kernels (every file in cpu/: the attention's, cpu_attention.py; the MoE's and its
routing, cpu_moe.py; the decode steps' projections, cpu_project.py; the mHC mix, cpu_mhc.py; the
compressors' feed, cpu_compressor.py), built into one library with the system's C compiler once per
machine into the cache (a few seconds; logged), under a key of their sources and flags. They are
written in 512-bit vectors (cpu/simd.h) and built for the CPU's vector instructions (`cpu_kernel_isa`):
AVX512-BF16, or AVX2 with FMA, on which each vector is two. The AMX kernels (cpu/*_amx.c) run only on
a CPU with AMX tiles, which has AVX512-BF16: they are built for it on every machine. Where the CPU has
neither or no compiler builds them, `available()` is False and the model computes in torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from dsv4.config import cache_dir
from dsv4.config.server_args import cpu_kernel_isa

log = logging.getLogger(__name__)

_SOURCES = tuple(sorted((Path(__file__).with_name("cpu")).glob("*.c")))
_HEADERS = tuple(sorted((Path(__file__).with_name("cpu")).glob("*.h")))
_AMX_SOURCES = tuple(source for source in _SOURCES if source.stem.endswith("_amx"))
_FLAGS = ("-O3", "-fPIC", "-fopenmp")
_ISA_FLAGS = {"avx512_bf16": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"),
              "avx2": ("-mavx2", "-mfma")}
ISAS = tuple(_ISA_FLAGS)  # what `build` builds for (cpu_kernel_isa says which this CPU runs)
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
    """Whether the kernels run here: the CPU has instructions they are built for (`cpu_kernel_isa`) and they
    are built (the first call builds them, or loads them from the cache)."""
    return _library() is not None


def entry(name: str):
    """The kernel `name` (returns 0, or non-zero where it could not allocate its scratch memory)."""
    library = _library()
    if library is None:
        raise RuntimeError("the CPU kernels are not available on this machine")
    return getattr(library, name)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernels, built (or found in the cache) on the first call; None where this CPU has no
    instructions they are built for or the build fails (logged)."""
    isa = cpu_kernel_isa()
    if isa is None:
        return None
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("cpu kernels: no C compiler (gcc or cc) to build the %s kernels; the model runs torch ops "
                    "instead", isa)
        return None
    key = hashlib.sha256(b"".join(source.read_bytes() for source in _SOURCES + _HEADERS)
                         + repr((_FLAGS, _source_flags(isa), compiler)).encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"cpu_kernels-{isa}-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.so")
        started = time.monotonic()
        try:
            build(isa, partial, compiler)
        except (OSError, subprocess.SubprocessError) as e:
            detail = e.stderr.decode(errors="replace")[-2000:] if getattr(e, "stderr", None) else str(e)
            log.warning("cpu kernels: building the %s kernels failed; the model runs torch ops instead: %s", isa,
                        detail)
            partial.unlink(missing_ok=True)
            return None
        os.replace(partial, path)  # whole or absent: a concurrent start never loads half a library
        log.info("cpu kernels: built the %s kernels in %.1f s", isa, time.monotonic() - started)
    library = ctypes.CDLL(str(path))  # (ctypes releases the GIL for each call)
    log.info("cpu kernels: the %s kernels are loaded (%s)", isa, path)
    for name, arguments in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = arguments, _RESULTS.get(name, ctypes.c_int)
    return library


def build(isa: str, library: Path, compiler: str) -> None:
    """Builds the kernels for `isa` (one of ISAS) into the shared library `library`: every source compiled at
    once, each by a process of its own, then linked. Raises CalledProcessError (the compiler's stderr in
    it) or TimeoutExpired past BUILD_TIMEOUT_S."""
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix="dsv4-kernels-") as objects:
        compiles = [subprocess.Popen([compiler, *_FLAGS, *flags, "-c", str(source), "-o", f"{source.stem}.o"],
                                     cwd=objects, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                    for source, flags in _source_flags(isa)]
        try:
            for process in compiles:
                _, errors = process.communicate(timeout=max(deadline - time.monotonic(), 0))
                if process.returncode:
                    raise subprocess.CalledProcessError(process.returncode, process.args, stderr=errors)
        finally:
            for process in compiles:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        subprocess.run([compiler, "-shared", "-fopenmp", *(f"{source.stem}.o" for source in _SOURCES), "-o",
                        str(library.resolve()), "-lm"], cwd=objects, check=True, capture_output=True,
                       timeout=max(deadline - time.monotonic(), 0))


def _source_flags(isa: str) -> tuple[tuple[Path, tuple[str, ...]], ...]:
    """Each source and the instructions it is built for: the ISA's, the AMX kernels AVX512-BF16's."""
    return tuple((source, _ISA_FLAGS["avx512_bf16" if source in _AMX_SOURCES else isa]) for source in _SOURCES)
