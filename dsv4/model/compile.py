"""Ahead-of-time compilation (AOTInductor) of the model's piece made of many tiny ops, once per machine.

Why: on the CPU a decode step is dominated by per-op overhead, not arithmetic, and mHC is most of a
step's ops: between every two sublayers (16 times a step in the small preset) the last output is
written into the streams and the next input collapsed from them, which normalises 4x4 mixing
matrices with 20 Sinkhorn iterations of row and column sums. Compiled, that `mix` is one call of
fused C++ kernels. Ahead of time rather than `torch.compile`'s just-in-time form because a call then
skips dynamo's guards on every input: measured in a c=1 decode step (small, fp32, 16 calls), 207 us
a call jit-compiled against ~100 us, and ~400 us eager.

The compiled function is the same math as the eager one (`dsv4.model.mhc.mix`, exported as it
stands); only the summation order of the fused code may differ, within fp32 rounding. Its token
count is symbolic, so one package serves every batch size. Its fused kernels run on one thread
(`cpp.threads`): they are small, and decode forwards run on one thread
(dsv4.engine.runner.PARALLEL_FORWARD_TOKENS); the matmul inside follows the calling thread's count.

Packages are kept in `cache` under a key of everything the code depends on (torch's version, the
CPU's vector ISA, the dtype and the model's mHC shape and constants, and the source of the modules
that define the math), so a restart on the same machine loads in a fraction of a second. Compiling
or loading is bounded by `timeout`: past it, or on any failure, the model serves eagerly and says so
(a slow compiler never keeps a server from starting; a compile that finishes late still fills the
cache for the next start).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import torch

from dsv4.config import ModelConfig

from . import mhc, ops
from .ops import accumulation_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pieces:
    """The implementations the model calls for its compilable pieces."""

    mix: Callable  # mhc.mix over tensors only (the model's constants bound)
    compiled: bool


def eager_pieces(cfg: ModelConfig) -> Pieces:
    return Pieces(mix=functools.partial(mhc.mix, **_mix_constants(cfg)), compiled=False)


def compile_pieces(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, timeout: float, cache: Path) -> Pieces:
    """The compiled pieces, loaded from `cache` or compiled into it; eager ones if that takes over
    `timeout` s or fails."""
    package = cache / f"mix-{_key(cfg, dtype, device)}.pt2"
    started = time.monotonic()
    action = "loading" if package.exists() else "compiling (once per machine and version)"
    log.info("%s the model's mHC mix with AOTInductor: %s (bounded by --compile-timeout %.0f s; --disable-compile "
             "to skip)", action, package, timeout)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv4-compile")
    try:
        runner = pool.submit(_load_or_compile, package, cfg, dtype, device).result(timeout=timeout)
    except FutureTimeout:
        log.warning("compiling did not finish within %.0f s: serving eagerly", timeout)
        return eager_pieces(cfg)
    except Exception as e:  # noqa: BLE001 -- any compiler failure means: serve eagerly, and say why
        log.warning("compiling failed (%s: %s): serving eagerly", type(e).__name__, e)
        return eager_pieces(cfg)
    finally:
        pool.shutdown(wait=False)
    log.info("compiled pieces ready in %.1f s (%s)", time.monotonic() - started, package)
    return Pieces(mix=runner, compiled=True)


class _Mix(torch.nn.Module):
    """`mhc.mix` as the module torch.export takes."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.constants = _mix_constants(cfg)

    def forward(self, streams, output, post, comb, fn, base, scale, norm):
        return mhc.mix(streams, output, post, comb, fn, base, scale, norm, **self.constants)


def _load_or_compile(package: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> Callable:
    if not package.exists():
        package.parent.mkdir(parents=True, exist_ok=True)
        tokens = torch.export.Dim("tokens", min=1)
        program = torch.export.export(_Mix(cfg), _example_inputs(cfg, dtype, device),
                                      dynamic_shapes=[{0: tokens}] * 4 + [None] * 4)
        partial = package.with_name(f"{package.stem}.{os.getpid()}.partial.pt2")
        configs = {"cpp.threads": 1} if device.type == "cpu" else {}
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial), inductor_configs=configs)
        os.replace(partial, package)  # whole or absent: a concurrent start never loads half a package
    compiled = torch._inductor.aoti_load_package(str(package))

    def mix(*tensors: torch.Tensor):
        # The package's kernels index their inputs as the contiguous examples were laid out; they
        # do not check strides (an expanded identity `comb` read as [T, n, n] rows reads garbage).
        return compiled(*(t.contiguous() for t in tensors))

    return mix


def _example_inputs(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    n, hidden, acc, tokens = cfg.hc_mult, cfg.hidden_size, accumulation_dtype(dtype), 2
    mixes = (2 + n) * n
    return (torch.zeros(tokens, n, hidden, dtype=dtype, device=device),
            torch.zeros(tokens, hidden, dtype=dtype, device=device),
            torch.zeros(tokens, n, dtype=acc, device=device),
            torch.zeros(tokens, n, n, dtype=acc, device=device),
            torch.zeros(mixes, n * hidden, dtype=acc, device=device),
            torch.zeros(mixes, dtype=acc, device=device),
            torch.ones(mixes, dtype=acc, device=device),
            torch.ones(hidden, dtype=acc, device=device))


def _mix_constants(cfg: ModelConfig) -> dict:
    return {"n": cfg.hc_mult, "sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
            "norm_eps": cfg.rms_norm_eps}


def _key(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> str:
    sources = b"".join(Path(module.__file__).read_bytes() for module in (mhc, ops))
    isa = torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else torch.cuda.get_device_name(device)
    facts = (torch.__version__, isa, str(dtype), device.type, cfg.hidden_size, sorted(_mix_constants(cfg).items()))
    return hashlib.sha256(repr(facts).encode() + sources).hexdigest()[:16]
