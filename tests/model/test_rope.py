"""RoPE read from kept tables (dsv4.model.ops.RopeTables) against RoPE computed at the same positions
(ops.Rope): the same tables to the bit, for the batches it reads (one position: views; a few: gathered rows)
and those it computes (many positions, positions past its largest table), as the tables grow."""

from __future__ import annotations

import pytest
import torch

from dsv4.model.ops import Rope, RopeTables, layer_inv_freq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", [0, 2])
def test_rope_tables_equal_rope_computed(tiny_ckpt, dtype, layer):
    from dsv4.config import ModelConfig

    inv_freq = layer_inv_freq(ModelConfig.from_json(tiny_ckpt), layer)
    tables = RopeTables(inv_freq, dtype)
    generator = torch.Generator().manual_seed(layer)
    batches = [torch.tensor([5]), torch.tensor([1023]), torch.tensor([1024]),  # the first table, then doubled
               torch.randint(0, 3000, (7,), generator=generator), torch.tensor([70_000]),  # past MAX_POSITIONS
               torch.randint(0, 5000, (RopeTables.MAX_TOKENS + 1,), generator=generator), torch.tensor([4095, 0, 17])]
    for positions in batches:
        got, want = tables.at(positions), Rope(positions, inv_freq, dtype)
        for name in ("cos", "sin", "cos2", "sin2"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (positions.tolist(), name)
        assert got.dim == want.dim and got.acc == want.acc
        window = torch.tensor([positions[0].item() // 4 * 4])  # (a window's rows rotated by the same frequencies)
        assert torch.equal(got.at(window).cos2, Rope(window, inv_freq, dtype).cos2)
    assert tables._table.cos.shape[0] == 4096  # (grown to the largest position it read, a power of two)
