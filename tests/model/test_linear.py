"""The model's fp32 matmuls on the CPU (`ops.linear`, and the MoE's grouped products), which run as
oneDNN's where torch has it (`ops.onednn_linear`), against float64 matmuls: the same sums, so within
fp32 rounding, whatever the rows, the layouts and the groups' sizes (empty ones included)."""

from __future__ import annotations

import pytest
import torch

from dsv4.model import moe, ops


def _close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    want = x.double() @ weight.double().T
    # fp32 sums of `in` products in any order: within in * 2^-24 of the sum of the products' magnitudes
    bound = x.shape[-1] * 2.0**-24 * (x.double().abs() @ weight.double().abs().T)
    return got.dtype == torch.float32 and got.shape == want.shape and bool(((got.double() - want).abs() <= bound).all())


def test_fp32_products_run_as_onednn_where_torch_has_it():
    weight = torch.zeros(4, 4)
    assert ops.onednn_serves(weight) == torch.backends.mkldnn.is_available()
    assert not ops.onednn_serves(weight.double()) and not ops.onednn_serves(weight.bfloat16())


@pytest.mark.parametrize("rows", [0, 1, 2, 7, 64, 300])
@pytest.mark.parametrize("dims", [(48, 40), (256, 520)], ids=["48->40", "256->520"])
def test_linear_in_fp32_equals_the_float64_product(rows, dims):
    g = torch.Generator().manual_seed(rows)
    inputs, outputs = dims
    x = torch.randn(rows, inputs, generator=g)
    weight = torch.randn(outputs, inputs, generator=g)
    assert _close(ops.linear(x, weight), x, weight)
    # strided rows (the exit's groups are column slices of its rows), rows in more dims, a weight that is a view
    wide = torch.randn(rows, 3 * inputs, generator=g)
    assert _close(ops.linear(wide[:, inputs : 2 * inputs], weight), wide[:, inputs : 2 * inputs], weight)
    assert _close(ops.linear(x.reshape(1, rows, inputs), weight), x.reshape(1, rows, inputs), weight)
    transposed = torch.randn(inputs, outputs, generator=g).T
    assert _close(ops.linear(x, transposed), x, transposed)


def test_linear_in_fp32_compiled_equals_eager():
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(5, 32, generator=g), torch.randn(24, 32, generator=g)
    compiled = torch.compile(ops.linear, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(x, weight), ops.linear(x, weight))


@pytest.mark.parametrize("sizes", [[16, 0, 32, 16], [0, 0, 0, 48], [128, 16, 16, 16]])
def test_grouped_products_in_fp32_equal_each_groups_float64_product(sizes):
    g = torch.Generator().manual_seed(len(sizes))
    x = torch.randn(sum(sizes) + 5, 40, generator=g)  # rows past the last group's end are left unset
    w = torch.randn(len(sizes), 24, 40, generator=g)
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    out = moe._grouped_matmul(x, w, ends)
    assert out.shape == (x.shape[0], 24)
    start = 0
    for group, end in enumerate(ends.tolist()):
        assert _close(out[start:end], x[start:end], w[group])
        start = end
