"""Sparse attention (Triton and vectorised torch) against the paged reference.

Both sides read the same packed rows (fp8 rows included: the reference dequantises the same
bytes), so they differ only by fp32 rounding order: dot products of <= 512 terms and softmax sums
over <= a few hundred rows, each ~1e-7 relative, hence rtol = atol = 1e-5 for fp32 queries. bf16
queries give bf16 outputs, which both sides round from fp32 values ~1e-7 apart: at most one bf16
step, rtol = 2^-7. Every row a token must not see is poisoned (|x| ~ 1e3), so a stray read
cannot hide inside these tolerances.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import pack, page_table, strided_pool, tokens_of, write_paged_rows

from dsv4.kernels.sparse_attention import sparse_attention_torch, sparse_attention_triton
from dsv4.reference.paged_ops import sparse_attention_paged

PAGE_SIZE = 128
IMPLS = {"triton": sparse_attention_triton, "torch": sparse_attention_torch}
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2**-7, "atol": 1e-5}}

# name: (requests as (chunk start, tokens), heads, dim, rope_dim, ring rows, HCA ratio, CSA picks)
CASES = {
    "decode_batch": ([(0, 1), (5, 1), (40, 1), (129, 1)], 16, 128, 64, 16, 16, 8),  # ring wraps at 129
    "prefill_longer_than_ring": ([(6, 12)], 16, 128, 64, 8, 16, 8),
    "mixed_batch_odd_sizes": ([(0, 3), (50, 1), (23, 2)], 20, 128, 64, 10, 16, 6),  # 2 head blocks
    "v4_shape": ([(300, 2)], 16, 512, 64, 128, 128, 16),  # 584-byte fp8 rows, 128-row ring
}


def build(case: str, fmt: str, mode: str, q_dtype: torch.dtype, device: str, seed: int = 0):
    requests, heads, dim, rope, ring, hca_ratio, picks = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    token_req, positions = tokens_of(requests)
    tokens = len(positions)
    req_slots = torch.tensor([2 * r + 1 for r in range(len(requests))])  # slots other than the request ids
    req_starts = torch.tensor([start for start, _ in requests])

    def rows(n):
        return pack(torch.randn(n, dim, generator=gen), fmt, rope)

    window = strided_pool(2 * len(requests) + 1, ring, fmt, dim, rope, device, gen)
    for (start, _), slot in zip(requests, req_slots.tolist(), strict=True):
        for p in range(max(0, start - ring), start):  # the ring holds the positions before the chunk
            window[slot, p % ring] = rows(1)[0].to(device)
    new_rows = rows(tokens).to(device)
    kwargs = {"row_format": fmt, "rope_dim": rope}
    if mode != "window":
        ratio = 4 if mode == "csa" else hca_ratio
        rows_per_page = PAGE_SIZE // ratio
        needed = [(start + count) // ratio for start, count in requests]
        table, num_pages = page_table(needed, rows_per_page, gen)
        compressed = strided_pool(num_pages, rows_per_page, fmt, dim, rope, device, gen)
        for r, n in enumerate(needed):
            write_paged_rows(compressed, table[r], rows(n).to(device))
        kwargs.update(compressed=compressed, page_table=table.to(device), ratio=ratio)
        if mode == "csa":
            kwargs["selected"] = csa_picks(positions, ratio, picks, gen).to(device)
    q = torch.randn(tokens, heads, dim, generator=gen).to(q_dtype)
    sink = torch.randn(heads, generator=gen)
    args = [q.to(device), sink.to(device), new_rows, window, token_req.to(device), positions.to(device),
            req_slots.to(device), req_starts.to(device)]
    return args, kwargs


def csa_picks(positions: torch.Tensor, ratio: int, count: int, gen) -> torch.Tensor:
    """Per token a random subset of its visible rows, -1 padded; one out-of-range entry where there
    is room (it must be ignored like -1: it names a row the token cannot see)."""
    picks = torch.full((len(positions), count), -1, dtype=torch.int32)
    for t, pos in enumerate(positions.tolist()):
        visible = (pos + 1) // ratio
        chosen = torch.randperm(visible, generator=gen)[:count]
        picks[t, : len(chosen)] = chosen.to(torch.int32)
        if len(chosen) < count:
            picks[t, len(chosen)] = visible + 1
    return picks


def check(impl: str, case: str, fmt: str, mode: str, q_dtype: torch.dtype, device: str) -> None:
    args, kwargs = build(case, fmt, mode, q_dtype, device)
    got = IMPLS[impl](*args, **kwargs)
    cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in kwargs.items()}
    want = sparse_attention_paged(*[a.cpu() for a in args], **cpu)
    assert got.dtype == q_dtype and got.shape == args[0].shape
    torch.testing.assert_close(got.cpu(), want, **TOLERANCE[q_dtype])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["window", "hca", "csa"])
@pytest.mark.parametrize("case", CASES)
def test_fp8_rows_match_reference(case, mode, impl, device):
    check(impl, case, "fp8_e4m3", mode, torch.float32, device)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["hca", "csa"])
@pytest.mark.parametrize("fmt,q_dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32),
                                         ("fp8_e4m3", torch.bfloat16)])
def test_row_formats_and_query_dtypes(fmt, q_dtype, mode, impl, device):
    check(impl, "decode_batch", fmt, mode, q_dtype, device)


@pytest.mark.parametrize("impl", IMPLS)
def test_compressed_rows_past_the_page_table_are_never_read(impl, device):
    """Two HCA rows are visible but the table holds one page (one row): only row 0 is attended,
    as if it were the only row selected."""
    args, kwargs = build("v4_shape", "fp8_e4m3", "hca", torch.float32, device)
    kwargs["page_table"] = kwargs["page_table"][:, :1]
    got = IMPLS[impl](*args, **kwargs)
    cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in kwargs.items()}
    want = sparse_attention_paged(*[a.cpu() for a in args], **cpu, selected=torch.zeros(len(args[0]), 1))
    torch.testing.assert_close(got.cpu(), want, **TOLERANCE[torch.float32])


def test_torch_path_attends_long_chunks_in_passes(monkeypatch, device):
    import dsv4.kernels.sparse_attention as module

    args, kwargs = build("prefill_longer_than_ring", "fp8_e4m3", "csa", torch.float32, device)
    whole = sparse_attention_torch(*args, **kwargs)
    monkeypatch.setattr(module, "PASS_BUDGET_ELEMENTS", 1)  # one token a pass
    torch.testing.assert_close(sparse_attention_torch(*args, **kwargs), whole, rtol=1e-6, atol=1e-6)


def test_float64_oracle_path(device):
    args, kwargs = build("decode_batch", "fp32", "csa", torch.float64, device)
    with pytest.raises(ValueError, match="float64"):
        sparse_attention_triton(*args, **kwargs)
    cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in kwargs.items()}
    want = sparse_attention_paged(*[a.cpu() for a in args], **cpu)
    torch.testing.assert_close(sparse_attention_torch(*args, **kwargs).cpu(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments_are_named(impl, device):
    args, kwargs = build("decode_batch", "fp8_e4m3", "csa", torch.float32, device)
    call = IMPLS[impl]
    with pytest.raises(ValueError, match="new_rows"):
        call(args[0], args[1], args[2][:-1], *args[3:], **kwargs)
    with pytest.raises(ValueError, match="window"):
        call(*args[:3], args[3][..., :-8], *args[4:], **kwargs)
    with pytest.raises(ValueError, match="compressed"):
        call(*args, **{**kwargs, "compressed": kwargs["compressed"][..., :-8]})
    with pytest.raises(ValueError, match="sink"):
        call(args[0], args[1][:3], *args[2:], **kwargs)
    with pytest.raises(ValueError, match="need compressed"):
        call(*args, row_format="fp8_e4m3", selected=kwargs["selected"])
    with pytest.raises(ValueError, match="page_table"):
        call(*args, **{**kwargs, "page_table": kwargs["page_table"][:1]})
