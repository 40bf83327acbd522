"""Builders for the kernel tests: paged pools laid out like `dsv4.memory.pools`, filled with
packed rows, with every row a test must not read "poisoned" (huge values) so a stray read shows."""

from __future__ import annotations

import torch

from dsv4.kernels.row_codec import row_bytes
from dsv4.kernels.rows import pack_index_rows, pack_main_rows, unpack_index_rows, unpack_main_rows

POISON = 1e3  # rows nobody should read hold values this large: reading one moves every result


def pack(x: torch.Tensor, fmt: str, rope_dim: int) -> torch.Tensor:
    return pack_index_rows(x, fmt) if fmt == "fp8" else pack_main_rows(x, fmt, rope_dim)


def unpack(buf: torch.Tensor, fmt: str, dim: int, rope_dim: int) -> torch.Tensor:
    return unpack_index_rows(buf, fmt, dim) if fmt == "fp8" else unpack_main_rows(buf, fmt, dim, rope_dim)


def strided_pool(units: int, rows: int, fmt: str, dim: int, rope_dim: int, device, gen) -> torch.Tensor:
    """uint8 [units, rows, row_bytes] viewed out of wider units, as a pool region is (another
    region before it, padding after), every row poisoned."""
    rb = row_bytes(fmt, dim, rope_dim)
    unit_bytes = 64 + -(-rows * rb // 64) * 64 + 64
    data = torch.zeros((units, unit_bytes), dtype=torch.uint8, device=device)
    view = data[:, 64 : 64 + rows * rb].unflatten(1, (rows, rb))
    view.copy_(pack(POISON * torch.randn(units * rows, dim, generator=gen), fmt, rope_dim).view(units, rows, rb))
    return view


def page_table(rows_needed: list[int], rows_per_page: int, gen, spare_pages: int = 3) -> tuple[torch.Tensor, int]:
    """Distinct, shuffled pages for each request's rows; returns (int32 [R, max_pages], num_pages).
    Unused table entries point at a page nobody owns (page 0 is never handed out)."""
    needed = [max(1, -(-n // rows_per_page)) for n in rows_needed]
    num_pages = 1 + sum(needed) + spare_pages
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    table = torch.zeros((len(needed), max(needed) + 1), dtype=torch.int32)
    for r, count in enumerate(needed):
        table[r, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
    return table, num_pages


def write_paged_rows(pool: torch.Tensor, pages: torch.Tensor, packed: torch.Tensor) -> None:
    """Store a request's rows 0..n-1 (packed [n, row_bytes]) at their paged addresses."""
    rows_per_page = pool.shape[1]
    for w in range(packed.shape[0]):
        pool[int(pages[w // rows_per_page]), w % rows_per_page] = packed[w]


def tokens_of(requests: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_req, positions) int64 [T] for requests given as (first position, token count)."""
    token_req, positions = [], []
    for r, (start, count) in enumerate(requests):
        token_req += [r] * count
        positions += list(range(start, start + count))
    return torch.tensor(token_req), torch.tensor(positions)
