"""The general MoE (`moe.grouped`): its groups of rows padded to GROUP_ROWS, so the grouped matmuls come in
few shapes (dsv4/model/moe.py), and its result against the reference's loop over experts, on every
tensor-parallel rank's share of the experts (the shares summed)."""

from __future__ import annotations

import functools

import pytest
import torch

from dsv4.model import moe
from dsv4.reference.moe import route as reference_route
from dsv4.reference.moe import swiglu_expert

HIDDEN, INTER, EXPERTS, TOP_K, LIMIT = 32, 16, 8, 2, 10.0
CONSTANTS = {"top_k": TOP_K, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5}
SHARES = {"all": [(0, 8)], "2 ranks": [(0, 4), (4, 4)], "3 ranks": [(0, 3), (3, 3), (6, 2)]}


def _layer(hash_routed: bool, g: torch.Generator):
    gate = torch.randn(EXPERTS, HIDDEN, generator=g, dtype=torch.float64) / HIDDEN**0.5
    route = (torch.randint(0, EXPERTS, (100, TOP_K), generator=g) if hash_routed
             else torch.randn(EXPERTS, generator=g, dtype=torch.float64) * 0.1)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g, dtype=torch.float64) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g, dtype=torch.float64) / INTER**0.5
    return gate, route, w13, w2


@pytest.mark.parametrize("share", [(0, 8), (0, 4), (4, 4), (6, 2)], ids=["all", "0-3", "4-7", "6-7"])
def test_each_group_is_padded_to_a_multiple_of_group_rows(share):
    g = torch.Generator().manual_seed(0)
    gate, route, _, _ = _layer(False, g)
    first, count = share
    for tokens in (1, 5, 17, 40):
        x = torch.randn(tokens, HIDDEN, generator=g, dtype=torch.float64)
        rows, places, picked, ends, _, keep = moe.dispatch(x, torch.arange(tokens), gate, route, first_expert=first,
                                                           local_experts=count, **CONSTANTS)
        assert ends.dtype == torch.int32 and ends.shape == (count,)
        assert (ends % moe.GROUP_ROWS == 0).all() and rows.shape == (tokens * TOP_K + count * (moe.GROUP_ROWS - 1), HIDDEN)
        assert places.unique().numel() == places.numel()  # every pick its own row
        assert torch.equal(rows[places], x[picked])
        padding = torch.ones(rows.shape[0], dtype=torch.bool)
        padding[places] = False
        assert not rows[padding].any()  # the padding rows are zero
        mine = keep.squeeze(-1)
        assert (places[mine] < ends[-1]).all() and (places[~mine] >= ends[-1]).all()
        # each of this rank's picks lies in the group of one of its token's experts, each group as tall
        # as its picks rounded up to GROUP_ROWS
        experts = reference_route(x, gate, bias=route, tid2eid=None, token_ids=torch.arange(tokens), top_k=TOP_K,
                                  score_func="sqrtsoftplus", normalise=True, scaling=1.5)[0]
        groups = torch.searchsorted(ends, places[mine].to(torch.int32), right=True)
        for token, group in zip(picked[mine].tolist(), groups.tolist(), strict=True):
            assert first + group in experts[token].tolist()
        picks = torch.bincount(groups, minlength=count)
        assert torch.equal(torch.diff(ends, prepend=ends.new_zeros(1)),
                           (picks + moe.GROUP_ROWS - 1) // moe.GROUP_ROWS * moe.GROUP_ROWS)
        assert int(picks.sum()) == int(((experts >= first) & (experts < first + count)).sum())


@pytest.mark.parametrize("hash_routed", [False, True], ids=["scored", "hash"])
@pytest.mark.parametrize("shares", SHARES.values(), ids=SHARES.keys())
def test_grouped_equals_the_reference_loop_over_experts(hash_routed, shares):
    g = torch.Generator().manual_seed(1)
    gate, route, w13, w2 = _layer(hash_routed, g)
    for tokens in (1, 3, 16, 33):
        x = torch.randn(tokens, HIDDEN, generator=g, dtype=torch.float64)
        token_ids = torch.randint(0, 100, (tokens,), generator=g)
        total = torch.zeros(tokens, HIDDEN, dtype=torch.float64)
        for first, count in shares:
            grouped = functools.partial(
                moe.grouped, dispatch=functools.partial(moe.dispatch, first_expert=first, local_experts=count,
                                                        **CONSTANTS),
                combine=functools.partial(moe.combine, swiglu_limit=LIMIT), swiglu_limit=LIMIT)
            mine = slice(first, first + count)
            total += grouped(x, token_ids, gate, route, w13[mine].contiguous(), w2[mine].contiguous(), None, None)
        experts, weights = reference_route(x, gate, bias=None if hash_routed else route,
                                           tid2eid=route if hash_routed else None, token_ids=token_ids, top_k=TOP_K,
                                           score_func="sqrtsoftplus", normalise=True, scaling=1.5)
        want = torch.zeros_like(total)
        for t in range(tokens):
            for slot, e in enumerate(experts[t].tolist()):
                w1, w3 = w13[e].chunk(2)
                want[t] += weights[t, slot] * swiglu_expert(x[t:t + 1], w1, w2[e], w3, LIMIT)[0]
        torch.testing.assert_close(total, want, rtol=1e-12, atol=1e-12)
