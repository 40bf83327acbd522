"""The decode steps' MoE (dsv4/model/compile.py, `moe_few`) against the general form, eagerly: `row_linear`
(and the attention's `decode_linear`) against `linear`, and the MoE that reads
each pick's expert in place (`moe.few`) against the sorted, grouped one (`moe.grouped`), on every
tensor-parallel rank's share of the experts. (Compiled, it is checked through the whole model in
test_compile.py, at TP=1.)"""

from __future__ import annotations

import functools

import pytest
import torch

from dsv4.model import moe
from dsv4.model.ops import FEW_TOKENS, decode_linear, linear, row_linear

HIDDEN, INTER, EXPERTS, TOP_K, LIMIT = 64, 32, 8, 2, 10.0


@pytest.mark.parametrize("product", [row_linear, decode_linear])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_are_linear(dtype, product):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 48, generator=g).to(dtype)
    weight = torch.randn(40, 48, generator=g).to(dtype)
    grouped = torch.randn(4, 16, 12, generator=g).to(dtype)  # [G, out, in]: wo_a's shape
    x_grouped = torch.randn(3, 4, 12, generator=g).to(dtype)
    rel = 1e-6 if dtype == torch.float32 else 1e-2  # fp32 sums in another order; bf16: one rounding apart
    for got, want in ((product(x, weight), linear(x, weight)), (product(x_grouped, grouped), linear(x_grouped, grouped))):
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        assert (got.float() - want.float()).abs().max() <= rel * want.float().abs().max()


def _layer(hash_routed: bool, g: torch.Generator):
    gate = torch.randn(EXPERTS, HIDDEN, generator=g) / HIDDEN**0.5
    route = (torch.randint(0, EXPERTS, (100, TOP_K), generator=g) if hash_routed
             else torch.randn(EXPERTS, generator=g) * 0.1)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5
    shared = (torch.randn(2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5, torch.randn(HIDDEN, INTER, generator=g) / INTER**0.5)
    return gate, route, w13, w2, shared


@pytest.mark.parametrize("shared_product", [linear, decode_linear], ids=["linear", "decode_linear"])
@pytest.mark.parametrize("hash_routed", [False, True], ids=["scored", "hash"])
@pytest.mark.parametrize("share", [(0, 8), (0, 4), (4, 4)], ids=["all", "rank0of2", "rank1of2"])
def test_few_equals_grouped(hash_routed, share, shared_product):
    g = torch.Generator().manual_seed(1)
    gate, route, w13, w2, shared = _layer(hash_routed, g)
    first, count = share
    constants = {"first_expert": first, "local_experts": count, "top_k": TOP_K, "scoring_func": "sqrtsoftplus",
                 "norm_topk_prob": True, "routed_scaling_factor": 1.5}
    grouped = functools.partial(moe.grouped, dispatch=functools.partial(moe.dispatch, **constants),
                                combine=functools.partial(moe.combine, swiglu_limit=LIMIT), swiglu_limit=LIMIT)
    mine = slice(first, first + count)
    for tokens in range(1, FEW_TOKENS + 1):
        x = torch.randn(tokens, HIDDEN, generator=g)
        token_ids = torch.randint(0, 100, (tokens,), generator=g)
        args = (x, token_ids, gate, route, w13[mine].contiguous(), w2[mine].contiguous(), *shared)
        want = grouped(*args)
        got = moe.few(*args, **constants, swiglu_limit=LIMIT, product=shared_product)
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
