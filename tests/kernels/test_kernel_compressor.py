"""The compressor step (Triton and vectorised torch) against the paged reference, and the paged
reference against the full-sequence reference `Compressor`.

fp32 rows of an fp32 model differ from the reference by summation order only (softmax over <= 128
slots, a mean of squares over <= 512 dims): rtol 1e-5. Rounded rows (bf16 model or bf16 / fp8
rows) may differ by one rounding step where the two fp32 values straddle a rounding boundary:
elementwise within one step (bf16: 2^-7 relative; e4m3: 2^-3 relative, or the subnormal quantum),
and almost every byte identical. The quantiser itself is tested exactly in test_kernel_row_codec.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import strided_pool, unpack

from dsv4.kernels.compressor import compress_insert_torch, compress_insert_triton
from dsv4.reference.compressor import Compressor
from dsv4.reference.paged_ops import compress_insert_paged
from dsv4.reference.rope import rope_inv_freq

IMPLS = {"triton": compress_insert_triton, "torch": compress_insert_torch}
EPS = 1e-6
ROWS_PER_PAGE = 4

# name: (ratio, dim, rope_dim, row format, model dtype, state layout, windows)
CASES = {
    "csa_main_fp8_decode": (4, 128, 64, "fp8_e4m3", torch.float32, "decode", [0, 1, 7]),
    "csa_main_fp8_bf16_model": (4, 128, 64, "fp8_e4m3", torch.bfloat16, "decode", [0, 5]),
    "csa_index_fp8_prefill": (4, 128, 64, "fp8", torch.bfloat16, "prefill", [0, 1, 2]),
    "csa_index_bf16_prefill": (4, 64, 32, "bf16", torch.bfloat16, "prefill", [5, 6, 7]),
    "csa_index_fp32": (4, 64, 32, "fp32", torch.float32, "decode", [0, 9]),
    "hca_main_fp8": (128, 128, 64, "fp8_e4m3", torch.bfloat16, "decode", [0, 2]),
    "hca_main_fp32_prefill": (128, 96, 32, "fp32", torch.float32, "prefill", [3, 4]),
    "v4_main_row_584_bytes": (4, 512, 64, "fp8_e4m3", torch.bfloat16, "decode", [11]),
}


def build(case: str, device: str, seed: int = 0):
    ratio, dim, rope, fmt, model_dtype, layout, windows = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    overlap = ratio == 4
    slots = 2 * ratio if overlap else ratio
    channels = 2 * (2 if overlap else 1) * dim
    emitted = len(windows)
    if layout == "decode":  # the pool's partial state: one unit per slot, the window at row 0
        unit_count, rows_per_unit = emitted + 2, slots
        units = torch.randperm(unit_count, generator=gen)[:emitted]
        first_rows = torch.zeros(emitted, dtype=torch.int64)
    else:  # consecutive windows' tokens in one unit, led (CSA) by the window before the first
        unit_count, rows_per_unit = 1, ratio * emitted + (ratio if overlap else 0)
        units = torch.zeros(emitted, dtype=torch.int64)
        first_rows = ratio * torch.arange(emitted)
    wide = torch.randn(unit_count, rows_per_unit, channels + 16, generator=gen)
    state = wide[..., :channels]  # strided like a view into the pools
    kv_channels = channels // 2
    state[..., :kv_channels] = state[..., :kv_channels].to(model_dtype).float()  # kv comes out of a model-dtype matmul
    state[..., kv_channels:] *= 3.0

    positions = torch.tensor(windows) * ratio
    inv_freq = rope_inv_freq(rope, 160000.0).float()
    angles = positions.float()[:, None] * inv_freq[None, :]
    norm_weight = (1 + 0.2 * torch.randn(dim, generator=gen)).to(model_dtype)
    num_pages = emitted + 2
    destinations = torch.randperm(num_pages * ROWS_PER_PAGE, generator=gen)[:emitted]
    pages, rows = destinations // ROWS_PER_PAGE, destinations % ROWS_PER_PAGE

    def cache():  # two identical poisoned caches: one for the op, one for the reference
        return strided_pool(num_pages, ROWS_PER_PAGE, fmt, dim, rope, device, torch.Generator().manual_seed(seed))

    tensors = [state, units, first_rows, torch.tensor(windows), angles.cos(), angles.sin(), norm_weight]
    kwargs = {"ratio": ratio, "row_format": fmt, "eps": EPS, "model_dtype": model_dtype}
    return [t.to(device) for t in tensors], cache, pages.to(device), rows.to(device), kwargs


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, fmt: str, dim: int, rope: int, exact_math: bool):
    got_rows, want_rows = unpack(got, fmt, dim, rope), unpack(want, fmt, dim, rope)
    if exact_math:
        torch.testing.assert_close(got_rows, want_rows, rtol=1e-5, atol=1e-6)
        return
    step = 2**-3 if fmt in ("fp8", "fp8_e4m3") else 2**-7
    floor = 2**-15 * want_rows.abs().amax(dim=1, keepdim=True)  # e4m3's subnormal quantum, relative to amax
    limit = step * torch.maximum(got_rows.abs(), want_rows.abs()) + floor
    assert ((got_rows - want_rows).abs() <= limit).all(), "a value is more than one rounding step away"
    assert (got == want).float().mean() >= 0.9, "too many bytes differ for rounding-boundary flips"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES)
def test_rows_match_reference(case, impl, device):
    _, dim, rope, fmt, model_dtype, *_ = CASES[case]
    tensors, cache, pages, rows, kwargs = build(case, device)
    got_cache, want_cache = cache(), cache().cpu()
    IMPLS[impl](*tensors, got_cache, pages, rows, **kwargs)
    compress_insert_paged(*[t.cpu() for t in tensors], want_cache, pages.cpu(), rows.cpu(), **kwargs)

    unit = got_cache._base  # the wider units the rows are cut from: bytes around the rows stay zero
    region = got_cache.shape[1] * got_cache.shape[2]
    assert not unit[:, :64].any() and not unit[:, 64 + region :].any(), "bytes outside the rows changed"
    got_cache = got_cache.cpu()
    written = torch.zeros(got_cache.shape[:2], dtype=torch.bool)
    written[pages.cpu(), rows.cpu()] = True
    assert torch.equal(got_cache[~written], want_cache[~written]), "rows nobody wrote changed"
    exact_math = fmt == "fp32" and model_dtype == torch.float32
    assert_rows_close(got_cache[written], want_cache[written], fmt, dim, rope, exact_math)


@pytest.mark.parametrize("impl", [*IMPLS, "reference"])
@pytest.mark.parametrize("ratio", [4, 128])
def test_paged_rows_equal_full_sequence_compressor(ratio, impl, device):
    """Feeding each window's tokens (kv | gate + ape, as the partial state holds them) through the
    paged op gives the rows the full-sequence reference computes from the hidden states."""
    gen = torch.Generator().manual_seed(ratio)
    hidden, dim, rope, windows = 16, 32, 16, 3
    overlap = ratio == 4
    coff = 2 if overlap else 1
    wkv, wgate = torch.randn(coff * dim, hidden, generator=gen), torch.randn(coff * dim, hidden, generator=gen)
    ape, norm = torch.randn(ratio, coff * dim, generator=gen), 1 + 0.2 * torch.randn(dim, generator=gen)
    inv_freq = rope_inv_freq(rope, 160000.0)
    compressor = Compressor(wkv, wgate, ape, norm, ratio=ratio, overlap=overlap, inv_freq=inv_freq, norm_eps=EPS)
    x = torch.randn(1, windows * ratio + 2, hidden, generator=gen)  # two tokens of an incomplete window
    want = compressor(x)[0]

    token_rows = torch.cat([x[0] @ wkv.T, x[0] @ wgate.T + ape[torch.arange(x.shape[1]) % ratio]], dim=1)
    lead = torch.zeros(ratio if overlap else 0, token_rows.shape[1])  # window 0 has no previous window
    state = torch.cat([lead, token_rows])[None]
    w = torch.arange(windows)
    angles = (w * ratio).float()[:, None] * inv_freq.float()[None, :]
    cache = torch.zeros((windows, 1, 4 * dim), dtype=torch.uint8)
    op = compress_insert_paged if impl == "reference" else IMPLS[impl]
    if impl == "triton":
        state, cache = state.to(device), cache.to(device)
    args = [state, torch.zeros_like(w), w * ratio, w, angles.cos(), angles.sin(), norm]
    op(*[a.to(state.device) for a in args], cache, w.to(state.device), torch.zeros_like(w).to(state.device),
       ratio=ratio, row_format="fp32", eps=EPS, model_dtype=torch.float32)
    torch.testing.assert_close(unpack(cache[:, 0].cpu(), "fp32", dim, rope), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments_are_named(impl, device):
    tensors, cache, pages, rows, kwargs = build("csa_main_fp8_decode", device)
    call = IMPLS[impl]
    with pytest.raises(ValueError, match="cache"):
        call(*tensors, cache()[..., :-1], pages, rows, **kwargs)
    with pytest.raises(ValueError, match="ratio"):
        call(*tensors, cache(), pages, rows, **{**kwargs, "ratio": 8})
    with pytest.raises(ValueError, match="channels"):
        call(tensors[0][..., :-2], *tensors[1:], cache(), pages, rows, **kwargs)
    with pytest.raises(ValueError, match="pages"):
        call(*tensors, cache(), pages[:1], rows, **kwargs)
    with pytest.raises(ValueError, match="cos"):
        call(*tensors[:4], tensors[4][:1], *tensors[5:], cache(), pages, rows, **kwargs)
