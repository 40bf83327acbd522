"""torch.compile of the model's pieces made of many tiny ops: done once at startup, bounded in time.

Why: on the CPU a decode step is dominated by per-op overhead, not arithmetic, and mHC's collapse
is ~40% of a step's ops (each of 2 sublayers per layer normalises its 4x4 mixing matrices with 20
Sinkhorn iterations of row and column sums). Compiled, a collapse is one fused kernel. The compiled
function is the same math as the eager one (`dsv4.model.mhc.collapse`); only the summation order of
the fused code may differ, within fp32 rounding.

Compilation happens here, before the model serves: each piece is called on dummy inputs for the
shapes the forward will use (one token: the concurrency-1 decode step, which torch specialises; and
a symbolic token count for everything else), under inference mode as the forward runs, and under
every torch thread count the forwards run with (dsv4.engine.runner picks one per forward): torch
guards compiled code on the thread count, and a call under a count the warm-up did not cover would
run eagerly. Inductor keeps what it built in its on-disk cache (logged), so a restart on the same
machine compiles from cache in seconds. If compiling takes longer than `timeout`, or fails, the
model serves eagerly and says so: a slow compiler never keeps a server from starting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from dsv4.config import ModelConfig

from .mhc import collapse
from .ops import accumulation_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pieces:
    """The implementations the model calls for its compiled pieces."""

    collapse: Callable
    compiled: bool


EAGER = Pieces(collapse=collapse, compiled=False)


def compile_pieces(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, timeout: float,
                   thread_counts: tuple[int, ...]) -> Pieces:
    """The compiled pieces, warmed up for this model's shapes under each of `thread_counts` (the torch
    thread counts forwards will run with); EAGER if that takes over `timeout` s."""
    if device.type == "cpu":
        # Inductor fixes a C++ kernel's thread count when it generates it; the collapse's kernels are
        # small and decode forwards run on one thread (dsv4.engine.runner.PARALLEL_FORWARD_TOKENS).
        import torch._inductor.config

        torch._inductor.config.cpp.threads = 1
    compiled = Pieces(collapse=torch.compile(collapse, dynamic=True), compiled=True)
    started = time.monotonic()
    log.info("compiling the model's mHC collapse with torch.compile (bounded by --compile-timeout %.0f s; "
             "--disable-compile to skip)", timeout)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv4-compile")
    try:
        pool.submit(_warm_up, compiled, cfg, dtype, device, thread_counts).result(timeout=timeout)
    except FutureTimeout:
        log.warning("torch.compile did not finish within %.0f s: serving eagerly", timeout)
        return EAGER
    except Exception as e:  # noqa: BLE001 -- any compiler failure means: serve eagerly, and say why
        log.warning("torch.compile failed (%s: %s): serving eagerly", type(e).__name__, e)
        return EAGER
    finally:
        pool.shutdown(wait=False)
    # A call whose guards the warm-up did not cover (a new stride or dtype) runs eagerly rather than
    # compiling mid-serving, which would stall that tick for seconds.
    torch.compiler.set_stance("eager_on_recompile")
    log.info("compiled in %.1f s (inductor cache: %s)", time.monotonic() - started, _inductor_cache())
    return compiled


def _warm_up(pieces: Pieces, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
             thread_counts: tuple[int, ...]) -> None:
    n, acc = cfg.hc_mult, accumulation_dtype(dtype)
    mixes = (2 + n) * n
    fn = torch.zeros(mixes, n * cfg.hidden_size, dtype=acc, device=device)
    base, scale = torch.zeros(mixes, dtype=acc, device=device), torch.ones(mixes, dtype=acc, device=device)
    with torch.inference_mode():
        for threads in sorted(set(thread_counts)):
            torch.set_num_threads(threads)  # this (warm-up) thread's setting, which the guards read
            for tokens in (1, 2):  # 1 is specialised by torch; 2 compiles the symbolic token count
                streams = torch.zeros(tokens, n, cfg.hidden_size, dtype=dtype, device=device)
                pieces.collapse(streams, fn, base, scale, n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)


def _inductor_cache() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()
