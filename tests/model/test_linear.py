"""The model's fp32 matmuls on the CPU (`ops.linear`, and the MoE's grouped products), which run as
oneDNN's where torch has it (`ops.onednn_linear`), against float64 matmuls: the same sums, so within
fp32 rounding, whatever the rows, the layouts and the groups' sizes (empty ones included); and its bf16
products, as torch's bf16 matmuls or widened to fp32 (`ops.widens_bf16`), alike."""

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


@pytest.mark.parametrize("fast_bf16", [True, False], ids=["bf16-matmul", "widened-to-fp32"])
@pytest.mark.parametrize("rows", [1, 9, 300])
def test_linear_in_bf16_is_the_fp32_sum_rounded_once_on_either_path(monkeypatch, fast_bf16, rows):
    monkeypatch.setattr(ops, "_CPU_HAS_FAST_BF16", fast_bf16)
    g = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 256, generator=g).bfloat16(), torch.randn(520, 256, generator=g).bfloat16()
    assert ops.widens_bf16(weight) is not fast_bf16 and not ops.widens_bf16(weight.float())
    grouped_x, grouped_weight = x.unflatten(-1, (4, 64)), weight.unflatten(-1, (4, 64)).transpose(0, 1)  # [4, 520, 64]
    for got, want, bound in [
        (ops.linear(x, weight), x.double() @ weight.double().T, 256 * 2.0**-24 * (x.double().abs() @ weight.double().abs().T)),
        (ops.linear(grouped_x, grouped_weight), torch.einsum("tgi,goi->tgo", grouped_x.double(), grouped_weight.double()),
         64 * 2.0**-24 * torch.einsum("tgi,goi->tgo", grouped_x.double().abs(), grouped_weight.double().abs()))]:
        # the fp32 sum (within its rounding of the exact one) rounded once to bf16: within half a bf16 step of it
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert bool(((got.double() - want).abs() <= bound + (want.abs() + bound) * 2.0**-8).all())


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
