"""The fast path's elementwise pieces: projections, a fused RMSNorm, RoPE from per-forward tables.

These are the model's own implementations, tested against `dsv4.reference` through the model's
outputs; they round as the reference does (norms and rotations in at least fp32, results in the
input's dtype), so fp32 results differ from it by summation order only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dsv4.config import WINDOW, ModelConfig
from dsv4.config.server_args import cpu_has_fast_bf16


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision of the sensitive math (norms, softmaxes, mHC, routing): at least float32."""
    return torch.promote_types(dtype, torch.float32)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] times weight [out, in] (the checkpoint's layout), or grouped, x [..., G, in] times
    weight [G, out, in]; in the weight's dtype."""
    x = x.to(weight.dtype)
    if widens_bf16(weight):
        return linear(x.float(), weight.float()).to(weight.dtype)
    if weight.dim() == 3:
        return torch.einsum("...gi,goi->...go", x, weight)
    if onednn_serves(weight):
        return onednn_linear(x, weight)
    return F.linear(x, weight)


def widens_bf16(weight: torch.Tensor) -> bool:
    """Whether `linear` multiplies by a bf16 weight in fp32 and rounds the result to bf16: on a CPU that
    does not multiply bf16 in hardware (cpu_has_fast_bf16), where torch's bf16 matmul is a dot product
    a row at a time, 4..5.5x slower than fp32's (AVX2, 2 threads, 256 rows: [8192, 256] 256 against 46
    ms, [512, 512] 14.8 against 2.7, the fp32 time including the weight's conversion). The same math:
    bf16 products are exact in fp32, summed in fp32 and rounded once, only in another order. Past a few
    rows the weight's conversion pays for itself; the CPU kernels take decode steps of up to
    cpu_project.KERNEL_TOKENS rows, and only where they do not run does a step of 3..8 rows pay it (the
    [8192, 256] weight at 3 rows: 9.6 against 4.0 ms)."""
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and not _CPU_HAS_FAST_BF16


# fp32 products on the CPU through oneDNN's matmul rather than F.linear's (MKL's): the same sums in
# another order, at 2.1..2.8x the pace on a Zen 5 (2 threads, [512, K] x [K, N] at 440..520 GFLOP/s
# against MKL's ~220, an AVX2 pace: MKL does not take its AVX512 code on AMD CPUs; 2 rows of a [3392, 512]
# weight 1.5x; one row of [512, 512] 21 us against 14, the one case measured slower)
_ONEDNN_FP32 = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_CPU_HAS_FAST_BF16 = cpu_has_fast_bf16()


def onednn_serves(weight: torch.Tensor) -> bool:
    """Whether products with `weight` run as `onednn_linear`: fp32 weights on the CPU."""
    return _ONEDNN_FP32 and weight.dtype == torch.float32 and weight.device.type == "cpu"


@torch.library.custom_op("dsv4::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) for fp32 CPU tensors, by oneDNN. An op of its own so that compiled pieces
    call it as it is: inductor's lowering of oneDNN's linear expects weights it has packed itself."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [None], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# Forwards of at most this many tokens (decode steps of up to four requests) run the compiled MoE that
# reads each pick's expert in place (`moe.few`, with `row_linear`); past it the grouped matmuls pay.
FEW_TOKENS = 4
# Forwards of at most this many tokens run the attention's compiled projections and exit with
# `decode_linear`'s products; at four tokens bf16 matmuls were faster (see there; three were not measured).
DECODE_TOKENS = 2


def as_bf16(*weights: torch.Tensor | None) -> tuple[torch.Tensor | None, ...] | None:
    """The weights (None: absent) as the CPU's C kernels read them: bf16 ones themselves, fp32 ones as
    contiguous bf16 copies where every one holds bf16 values (a bf16 checkpoint served in fp32: the same
    math from half the bytes); None where they cannot (other dtypes, values bf16 would round)."""
    present = [w for w in weights if w is not None]
    if all(w.dtype == torch.bfloat16 for w in present):
        return weights
    if not all(w.dtype == torch.float32 for w in present):
        return None
    copies = tuple(None if w is None else w.to(torch.bfloat16).contiguous() for w in weights)
    if any(w is not None and not torch.equal(copy.float(), w) for w, copy in zip(weights, copies, strict=True)):
        return None
    return copies


def row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`linear` for the few rows of a decode step, written as products summed in at least fp32 and
    rounded once into x's dtype, the model's (what a matmul computes, summed in another order; the
    weight may be stored narrower, holding that dtype's values: dsv4/model/compile.py `_bf16_twins`).
    The compiled MoE of a decode step (`moe.few`) multiplies by each pick's expert this way, so that
    the indexed weight is read in place rather than copied. Compiled, it is a fused kernel whose threads
    split the rows (dsv4/model/compile.py): for a whole weight, a matmul over every core is faster
    (Xeon with AMX, 2 cores, one row of a 256 x 8192 weight on one thread: bf16 6.5 GB/s against
    F.linear's 14.2, fp32 7.8 against 22.3); on one thread of a Zen 4, where MKL is slow, it was the
    other way (fp32 20 GB/s against 7.8). Eager it would materialise every product: never run it so."""
    acc = accumulation_dtype(x.dtype)
    return (x.to(acc).unsqueeze(-2) * weight.to(acc)).sum(-1).to(x.dtype)


def decode_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`linear` for the one or two rows of a decode step (x [T, in], or grouped x [T, G, in]), inside a
    compiled piece, as products summed in at least fp32 with the output features as the outer loop: the
    compiled kernel spreads them over every thread and reads the weight once, at the pace of a plain
    sum over it. The compiled decode pieces multiply this way where that is faster than this machine's
    one-row matmuls (`one_row_linear_lag`): oneDNN's bf16 matmul of a row or two lays its weight out
    anew on every call (Xeon with AMX, 2 cores, one row: a [8192, 256] bf16 weight 151 us against
    F.linear's 246, [512, 512] 20 against 40; at four rows the matmul wins, 309 against 389 us), and
    on a Zen 4 MKL's fp32 one-row matmul reads at a third of a sum's pace (the same [8192, 256] in
    fp32: 363 against 1070 us). The same sums as a matmul in another order, rounded once into x's
    dtype (the model's; the weight may be stored narrower, as `row_linear`'s). Eager it would
    materialise every product: compiled only."""
    acc = accumulation_dtype(x.dtype)
    # Grouped: one group at a time (their number is the model's, so the loop unrolls), faster than one
    # product broadcast over all groups (small's exit at one token: 120 against 203 us)
    if weight.dim() == 3:
        return torch.stack([decode_linear(x[:, g], weight[g]) for g in range(weight.shape[0])], dim=1)
    return (weight.to(acc).unsqueeze(1) * x.to(acc).unsqueeze(0)).sum(-1).t().to(x.dtype)


def one_row_linear_lag(weights: list[torch.Tensor], threads: int) -> float:
    """How many times as long `linear` of one row takes over `weights` as a sum over each of their rows,
    which reads them at the pace of `decode_linear`'s compiled products (a [4096, 1024] fp32 weight on a
    Zen 4: the products 626 us, ATen's sum 617); measured on the calling thread at `threads` threads,
    three passes each."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(1, weights[0].shape[1], dtype=weights[0].dtype, device=weights[0].device)

        def seconds(product: Callable) -> float:
            product(weights[0])  # (the first call of each may set up)
            started = time.perf_counter()
            for _ in range(3):
                for weight in weights:
                    product(weight)
            return time.perf_counter() - started

        return seconds(lambda weight: linear(x, weight)) / seconds(lambda weight: weight.sum(-1))
    finally:
        torch.set_num_threads(before)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim in at least fp32 (optionally times `weight`) in one fused op;
    returns x's dtype."""
    acc = accumulation_dtype(x.dtype)
    return F.rms_norm(x.to(acc), x.shape[-1:], None if weight is None else weight.to(acc), eps).to(x.dtype)


def layer_inv_freq(cfg: ModelConfig, layer: int) -> torch.Tensor:
    """float64 [rope_head_dim / 2]: one inverse frequency per rotated pair. Window layers use plain
    RoPE with rope_theta; compressed layers use compress_rope_theta with YaRN interpolation."""
    dim = cfg.rope_head_dim
    if cfg.layer_kind(layer) == WINDOW:
        return _inv_freq(dim, cfg.rope_theta)
    theta, yarn = cfg.compress_rope_theta, cfg.rope_scaling
    base = _inv_freq(dim, theta)
    if yarn is None:
        return base

    def pair_turning(rotations: float) -> float:  # the pair whose wavelength fits `rotations` times in context
        context = yarn.original_max_position_embeddings
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    # Pairs below `low` turn often enough to keep their frequency; pairs above `high` are divided by
    # the factor; a linear ramp in between. The ends are whole pair indices (floor / ceil).
    low = max(math.floor(pair_turning(yarn.beta_fast)), 0)
    high = min(math.ceil(pair_turning(yarn.beta_slow)), dim - 1)
    high = high + 0.001 if high == low else high  # a finite slope
    share = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return base * (1 - share) + base / yarn.factor * share


def _inv_freq(dim: int, theta: float) -> torch.Tensor:
    return theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)


class Rope:
    """RoPE at fixed positions: the cos / sin tables are computed once (per forward and frequency
    set) and every rotation at those positions reads them. Rotates the last 2 * len(inv_freq) dims
    in interleaved pairs (2i, 2i+1 share frequency i) of [T, D] or [T, heads, D] tensors."""

    def __init__(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
        """`dtype`: the compute dtype; the tables are in its accumulation dtype."""
        self.acc, self.inv_freq = accumulation_dtype(dtype), inv_freq
        self.tables: RopeTables | None = None  # where `at` reads other positions' tables (None: computed)
        angles = positions.to(self.acc).unsqueeze(-1) * inv_freq.to(positions.device, self.acc)  # [T, R/2]
        self.cos, self.sin = angles.cos(), angles.sin()
        # Interleaved [T, R] tables: even' = even*cos - odd*sin and odd' = odd*cos + even*sin are
        # x * cos2 + swap_pairs(x) * sin2 with sin2 = (-sin, +sin) per pair.
        self.cos2 = self.cos.repeat_interleave(2, dim=-1)
        self.sin2 = torch.stack([-self.sin, self.sin], dim=-1).flatten(-2)
        self.dim = self.cos2.shape[-1]

    def at(self, positions: torch.Tensor) -> Rope:
        """RoPE of the same frequencies at other positions."""
        if self.tables is not None:
            return self.tables.at(positions)
        return Rope(positions, self.inv_freq, self.acc)

    def rows(self, index: torch.Tensor) -> Rope:
        """The tables' rows `index` (int64 [n] on their device) as a Rope of those rows' positions."""
        rope = Rope.__new__(Rope)
        rope.acc, rope.inv_freq, rope.dim, rope.tables = self.acc, self.inv_freq, self.dim, self.tables
        if len(index) == 1:  # (a decode step of one token: views)
            row = int(index[0])
            rope.cos, rope.sin, rope.cos2, rope.sin2 = (t[row : row + 1] for t in (self.cos, self.sin, self.cos2, self.sin2))
        else:
            rope.cos, rope.sin, rope.cos2, rope.sin2 = (t.index_select(0, index)
                                                        for t in (self.cos, self.sin, self.cos2, self.sin2))
        return rope

    def rotate_(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotates x [T, D] or [T, heads, D] in place (backwards with `inverse`) and returns it: callers
        pass tensors they own, so the other D - dim dims are not copied."""
        return rotate_(x, self.cos2, self.sin2, inverse)


class RopeTables:
    """RoPE of one set of frequencies at the positions of small CPU batches (decode steps), read from the
    tables of positions 0 .. n - 1, kept (n doubles up to the largest position asked, at most
    MAX_POSITIONS): the values `Rope` computes at those positions (elementwise math: a position's row is
    the same computed alone or among others), in one to four indexing ops instead of ~10 computing ones
    (a `small` c=1 decode step: its two Ropes took ~80 us)."""

    MAX_POSITIONS = 1 << 16
    MAX_TOKENS = 64  # larger batches compute theirs (their cost is in the math, not the ops)
    FIRST_SIZE = 1024

    def __init__(self, inv_freq: torch.Tensor, dtype: torch.dtype):
        self.inv_freq, self.dtype = inv_freq, dtype
        self._table: Rope | None = None  # at positions 0 .. n - 1

    def at(self, positions: torch.Tensor) -> Rope:
        if positions.device.type != "cpu" or not 0 < len(positions) <= self.MAX_TOKENS:
            return self._computed(positions)
        table = self.table(int(positions.max()))
        return self._computed(positions) if table is None else table.rows(positions)

    def table(self, last: int) -> Rope | None:
        """The kept tables, a Rope at positions 0 .. n - 1 for an n past `last` (grown where it is not);
        None past MAX_POSITIONS."""
        if last >= self.MAX_POSITIONS:
            return None
        table = self._table
        if table is None or last >= table.cos.shape[0]:
            size = max(self.FIRST_SIZE, 1 << last.bit_length())
            table = self._table = Rope(torch.arange(size, device=self.inv_freq.device), self.inv_freq, self.dtype)
            table.tables = self
        return table

    def _computed(self, positions: torch.Tensor) -> Rope:
        rope = Rope(positions, self.inv_freq, self.dtype)
        rope.tables = self
        return rope


def rotate_(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`Rope.rotate_` with its interleaved tables cos2, sin2 [T, R] (in the accumulation dtype)."""
    if x.dim() == 3:
        cos2, sin2 = cos2.unsqueeze(1), sin2.unsqueeze(1)
    tail = x[..., -cos2.shape[-1] :]
    wide = tail.to(cos2.dtype)
    swapped = wide.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    tail.copy_(torch.addcmul(wide * cos2, swapped, sin2, value=-1 if inverse else 1))
    return x
