"""The mHC mix between two sublayers (dsv4.model.mhc.mix) as one C kernel (cpu/mhc.c; AVX512 or AVX2), for
fp32 or bf16 streams: each token's streams read once and mixed, normalised, collapsed and normed while
they are in cache, the 4x4 Sinkhorn as vector code over four tokens at once. The same math in fp32 as `mix`, rounded into the
streams' dtype where it rounds; its oracle is `mix` (its test runs both against float64)."""

from __future__ import annotations

import ctypes

import torch

from .cpu_library import as_read, available, entry

__all__ = ["MAX_STREAMS", "available", "mix", "serves"]

MAX_STREAMS = 8  # cpu/mhc.c's MAX_STREAMS
_DTYPES = (torch.float32, torch.bfloat16)


def serves(dtype: torch.dtype, device: torch.device, streams: int) -> bool:
    """Whether `mix` runs for a model of this dtype on this device with `streams` residual streams."""
    return device.type == "cpu" and dtype in _DTYPES and streams <= MAX_STREAMS and available()


def mix_params(tokens: int, n: int, hidden: int, sinkhorn_iters: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The mix kernel's p[] (cpu/mhc.c's M_*)."""
    return tokens, n, hidden, sinkhorn_iters, dtype == torch.bfloat16


def mix(streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
        base: torch.Tensor, scale: torch.Tensor, norm: torch.Tensor, *, n: int, sinkhorn_iters: int, hc_eps: float,
        norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`dsv4.model.mhc.mix`: streams [T, n, hidden] and output [T, hidden] (fp32 or bf16), post [T, n]
    and comb [T, n, n] fp32, the sublayer's fn [(2 + n) * n, n * hidden], base and scale [(2 + n) * n]
    (scale repeated per mix) and norm [hidden], fp32 -> (streams, the sublayer's normed input [T, hidden],
    post, comb)."""
    tokens, hidden = output.shape
    mixes = (2 + n) * n
    problems = []
    if streams.dtype not in _DTYPES or output.dtype != streams.dtype or streams.device.type != "cpu":
        problems.append(f"streams and output must be fp32 or bf16 CPU tensors of one dtype (got {streams.dtype}, "
                        f"{output.dtype} on {streams.device})")
    if streams.shape != (tokens, n, hidden) or post.shape != (tokens, n) or comb.shape != (tokens, n, n):
        problems.append(f"streams {tuple(streams.shape)}, post {tuple(post.shape)} and comb {tuple(comb.shape)} "
                        f"do not fit output {tuple(output.shape)} and n {n}")
    if fn.shape != (mixes, n * hidden) or base.shape != (mixes,) or scale.shape != (mixes,) or norm.shape != (hidden,):
        problems.append(f"fn {tuple(fn.shape)}, base {tuple(base.shape)}, scale {tuple(scale.shape)} and norm "
                        f"{tuple(norm.shape)} do not fit n {n} and hidden {hidden}")
    if any(t.dtype != torch.float32 for t in (post, comb, fn, base, scale, norm)):
        problems.append("post, comb and the mixing weights must be fp32")
    if n > MAX_STREAMS:
        problems.append(f"at most {MAX_STREAMS} streams (got {n})")
    if problems:
        raise RuntimeError("mhc mix: " + "; ".join(problems))
    inputs = [as_read(t) for t in (streams, output, post, comb, fn, base, scale, norm)]
    outputs = (torch.empty_like(inputs[0]), torch.empty_like(inputs[1]), torch.empty_like(inputs[2]),
               torch.empty_like(inputs[3]))
    params = mix_params(tokens, n, hidden, sinkhorn_iters, streams.dtype)
    threads = torch.get_num_threads()
    status = entry("mhc_mix")(*(t.data_ptr() for t in inputs), *(t.data_ptr() for t in outputs),
                              (ctypes.c_int64 * len(params))(*params), hc_eps, norm_eps, threads)
    if status != 0:
        raise MemoryError("mhc mix: the kernel could not allocate its scratch memory")  # (n was checked)
    return outputs
