"""The three ops over the real pool layout (`dsv4.memory.pools.StatePools`): the compressor inserts
a CSA layer's index keys and main rows, the indexer selects over those keys, attention reads the
selected rows and the window ring, each checked against the reference."""

from __future__ import annotations

import torch
from kernel_cases import pack
from test_kernel_indexer_topk import assert_selection

from dsv4.config import ModelConfig
from dsv4.kernels import dispatch
from dsv4.kernels.compressor import compress_insert_triton
from dsv4.kernels.indexer_topk import indexer_topk_triton
from dsv4.kernels.sparse_attention import sparse_attention_triton
from dsv4.memory.pools import StatePools
from dsv4.reference.paged_ops import sparse_attention_paged

PAGE_SIZE, LAYER = 128, 1
CFG = ModelConfig(vocab_size=32, hidden_size=16, num_layers=3, num_heads=16, head_dim=128, rope_head_dim=64,
                  q_lora_rank=16, o_groups=2, o_lora_rank=8, n_routed_experts=2, n_shared_experts=1,
                  num_experts_per_tok=1, moe_intermediate_size=8, num_hash_layers=0, sliding_window=16,
                  index_n_heads=16, index_head_dim=64, index_topk=8, compress_ratios=(0, 4, 128))


def layout_views(regions, units: int, unit_bytes: int, device) -> dict[str, torch.Tensor]:
    """Each region of a pool's published layout as a [units, rows, row_bytes] view of one buffer
    on `device`: the pools' own views, byte for byte and stride for stride, wherever they live."""
    data = torch.zeros((units, unit_bytes), dtype=torch.uint8, device=device)
    return {r.name: data[:, r.offset : r.offset + r.nbytes].unflatten(1, (r.rows, r.row_bytes)) for r in regions}


def insert_rows(pools_view, fmt, dim, rope, windows, table, gen, device):
    """Compress `windows` consecutive windows (prefill layout) into a pool view, via Triton."""
    slots_state = torch.randn(1, 4 * (windows + 1), 4 * dim, generator=gen).to(device)
    w = torch.arange(windows)
    angles = (4 * w).float()[:, None] * torch.rand(rope // 2, generator=gen)[None, :]
    rows_per_page = pools_view.shape[1]
    compress_insert_triton(slots_state, torch.zeros_like(w).to(device), (4 * w).to(device), w.to(device),
                           angles.cos().to(device), angles.sin().to(device), torch.ones(dim).to(device), pools_view,
                           table[w // rows_per_page].to(device), (w % rows_per_page).to(device),
                           ratio=4, row_format=fmt, eps=1e-6, model_dtype=torch.bfloat16)


def test_ops_over_state_pools(device):
    gen = torch.Generator().manual_seed(0)
    pools = StatePools(CFG, num_pages=6, num_slots=3, page_size=PAGE_SIZE, dtype=torch.bfloat16,
                       kv_cache_dtype="fp8_e4m3", index_key_dtype="fp8")
    page_views = layout_views(pools.page_layout(), pools.num_pages, pools.page_bytes, device)
    slot_views = layout_views(pools.slot_layout(), pools.num_slots, pools.slot_bytes, device)
    keys, compressed = page_views[f"layers.{LAYER}.index_keys"], page_views[f"layers.{LAYER}.compressed"]
    ring = slot_views[f"layers.{LAYER}.window"]
    for ours, theirs in ((keys, pools.index_keys(LAYER)), (compressed, pools.compressed_rows(LAYER)),
                         (ring, pools.window(LAYER))):
        assert ours.shape == theirs.shape and ours.stride() == theirs.stride()
    table = torch.tensor([[4, 1, 5]], dtype=torch.int32)  # 40 index rows cross a 32-row page boundary
    positions = torch.tensor([160, 161])
    windows = (int(positions.max()) + 1) // 4
    insert_rows(keys, "fp8", CFG.index_head_dim, CFG.rope_head_dim, windows, table[0], gen, device)
    insert_rows(compressed, "fp8_e4m3", CFG.head_dim, CFG.rope_head_dim, windows, table[0], gen, device)

    token_req = torch.zeros(2, dtype=torch.int64)
    q_index = torch.randn(2, CFG.index_n_heads, CFG.index_head_dim, generator=gen)
    weights = torch.randn(2, CFG.index_n_heads, generator=gen)
    index_args = [q_index.to(device), weights.to(device), keys, "fp8", table.to(device), token_req.to(device),
                  positions.to(device)]
    selected = indexer_topk_triton(*index_args, CFG.index_topk)
    assert_selection(selected, index_args, CFG.index_topk)

    slot = torch.tensor([2])
    for p in range(160 - CFG.sliding_window, 160):  # the ring holds the positions before the chunk
        row = pack(torch.randn(1, CFG.head_dim, generator=gen), "fp8_e4m3", CFG.rope_head_dim)[0]
        ring[2, p % CFG.sliding_window] = row.to(device)
    new_rows = pack(torch.randn(2, CFG.head_dim, generator=gen), "fp8_e4m3", 64).to(device)
    q = torch.randn(2, CFG.num_heads, CFG.head_dim, generator=gen)
    args = [q.to(device), torch.randn(CFG.num_heads, generator=gen).to(device), new_rows, ring, token_req.to(device),
            positions.to(device), slot.to(device), torch.tensor([160]).to(device)]
    kwargs = {"row_format": "fp8_e4m3", "compressed": compressed, "page_table": table.to(device), "ratio": 4,
              "selected": selected}
    got = sparse_attention_triton(*args, **kwargs)
    cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in kwargs.items()}
    want = sparse_attention_paged(*[a.cpu() for a in args], **cpu)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dispatch.sparse_attention(*args, **kwargs).cpu(), want, rtol=1e-5, atol=1e-5)
