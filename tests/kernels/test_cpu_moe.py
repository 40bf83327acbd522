"""The decode steps' MoE kernel (dsv4/kernels/cpu_moe.py) against the grouped MoE's torch code
(dsv4.model.moe.grouped, which the model tests hold against the reference) and float64."""

import functools

import pytest
import torch

from dsv4.kernels import cpu_attention, cpu_moe
from dsv4.model import moe

pytestmark = pytest.mark.skipif(not cpu_moe.available(), reason="the CPU kernels do not run here (no AVX512-BF16 or AVX2, or no C compiler)")

LIMIT = 7.0


def experts_of(seed: int, experts: int, hidden: int, inter: int, shared: int):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).bfloat16()
    shared_weights = (None, None)
    if shared:
        shared_weights = ((torch.randn(2 * shared, hidden, generator=g) * hidden**-0.5).bfloat16(),
                          (torch.randn(hidden, shared, generator=g) * shared**-0.5).bfloat16())
    gate = torch.randn(experts, hidden, generator=g) * hidden**-0.5
    return gate, w13, w2, shared_weights


@pytest.mark.parametrize("tokens,experts,hidden,inter,shared,top_k,rank", [
    (1, 8, 512, 256, 256, 2, None), (4, 8, 512, 256, 256, 2, None), (3, 6, 96, 40, 0, 3, None),
    (2, 4, 72, 40, 24, 2, (1, 2)), (1, 16, 48, 24, 40, 4, (0, 5)), (32, 8, 512, 256, 256, 2, None),
    (19, 6, 96, 40, 24, 3, (1, 4)), (cpu_moe.KERNEL_TOKENS, 16, 64, 32, 0, 6, None)])
def test_matches_grouped(tokens, experts, hidden, inter, shared, top_k, rank):
    """Scored routing (its bias random so picks spread); `rank`: (first, count) of a tensor-parallel
    rank's experts, whose other picks drop out. Widths past a multiple of 32 exercise the kernel's masked tails;
    token counts past a few give experts picks in every number of the kernel's blocks of rows."""
    matches_grouped(cpu_moe.moe_few, tokens, experts, hidden, inter, shared, top_k, rank)


@pytest.mark.parametrize("tiles", [True, False], ids=["tiles", "dots"])
@pytest.mark.parametrize("tokens,experts,hidden,inter,shared,top_k,rank", [
    (1, 8, 512, 256, 256, 2, None), (32, 8, 512, 256, 256, 2, None), (19, 6, 96, 64, 32, 3, (1, 4)),
    (77, 16, 64, 32, 0, 6, None), (300, 8, 128, 64, 96, 2, (2, 5)), (5, 4, 64, 32, 32, 2, (1, 2)),
    (512, 8, 512, 256, 256, 2, None)])
def test_blocks_match_grouped(tiles, tokens, experts, hidden, inter, shared, top_k, rank):
    """The block kernel, on AMX tiles and on AVX512-BF16: as the other, over token counts that give experts
    several blocks of 16 picks and blocks of every size, and tensor-parallel ranks' experts."""
    if tiles and not cpu_attention.amx_available():
        pytest.skip("the CPU lacks AMX tiles")
    matches_grouped(functools.partial(cpu_moe.moe_blocks, tiles=tiles), tokens, experts, hidden, inter, shared, top_k,
                    rank)


def matches_grouped(kernel, tokens, experts, hidden, inter, shared, top_k, rank):
    gate, w13, w2, (shared_w13, shared_w2) = experts_of(tokens * 7 + hidden, experts, hidden, inter, shared)
    first, local = rank or (0, experts)
    w13, w2 = w13[first:first + local], w2[first:first + local]
    x = (torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(5)) * 3).bfloat16()
    x[0, :5] = torch.tensor([40.0, -40.0, 0.0, 1e-3, -7.5])  # (some rows push the SwiGLU into its clamps)
    token_ids = torch.arange(tokens)
    bias = torch.randn(experts, generator=torch.Generator().manual_seed(9))
    constants = {"first_expert": first, "local_experts": local, "top_k": top_k, "scoring_func": "sqrtsoftplus",
                 "norm_topk_prob": True, "routed_scaling_factor": 1.5}
    dispatch = functools.partial(moe.dispatch, **constants)
    expected = moe.grouped(x, token_ids, gate, bias, w13, w2, shared_w13, shared_w2, dispatch=dispatch,
                           combine=functools.partial(moe.combine, swiglu_limit=LIMIT), swiglu_limit=LIMIT)
    _, places, picked_tokens, ends, scale, keep = dispatch(x, token_ids, gate, bias)
    got = kernel(x, picked_tokens, places, ends, scale, keep, w13, w2, shared_w13, shared_w2, swiglu_limit=LIMIT)
    assert got.dtype == torch.float32 and got.shape == (tokens, hidden)
    # Each projection rounds into bf16 in both; a sum in another order may round one ulp apart there
    assert torch.allclose(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    exact = float64_moe(x, picked_tokens, places, ends, scale, keep, w13, w2, shared_w13, shared_w2)
    scale_of_output = exact.abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 2e-2 * scale_of_output
    assert (got.double() - exact).abs().max() <= 1.5 * (expected.double() - exact).abs().max() + 1e-3 * scale_of_output


@pytest.mark.parametrize("tokens,experts,hidden,inter,shared,top_k,rank", [
    (1, 8, 512, 256, 256, 2, None), (3, 6, 96, 40, 0, 3, None), (19, 6, 96, 40, 24, 3, (1, 4)),
    (32, 8, 512, 256, 256, 2, None)])
def test_fp32_matches_grouped(tokens, experts, hidden, inter, shared, top_k, rank):
    """An fp32 model's MoE from the bf16 copies of its weights (which hold bf16 values): fp32 arithmetic
    without rounding in between, as `grouped` in fp32 over the fp32 weights, to fp32's precision."""
    gate, w13, w2, (shared_w13, shared_w2) = experts_of(tokens * 11 + hidden, experts, hidden, inter, shared)
    first, local = rank or (0, experts)
    w13, w2 = w13[first:first + local], w2[first:first + local]
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(6)) * 3
    x[0, :3] = torch.tensor([40.0, -40.0, 1e-3])
    token_ids = torch.arange(tokens)
    bias = torch.randn(experts, generator=torch.Generator().manual_seed(8))
    dispatch = functools.partial(moe.dispatch, first_expert=first, local_experts=local, top_k=top_k,
                                 scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5)
    wide = [None if w is None else w.float() for w in (w13, w2, shared_w13, shared_w2)]
    expected = moe.grouped(x, token_ids, gate, bias, *wide, dispatch=dispatch,
                           combine=functools.partial(moe.combine, swiglu_limit=LIMIT), swiglu_limit=LIMIT)
    _, places, picked_tokens, ends, scale, keep = dispatch(x, token_ids, gate, bias)
    got = cpu_moe.moe_few(x, picked_tokens, places, ends, scale, keep, w13, w2, shared_w13, shared_w2,
                          swiglu_limit=LIMIT)
    exact = float64_moe(x, picked_tokens, places, ends, scale, keep, w13, w2, shared_w13, shared_w2)
    size = exact.abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 4 * (expected.double() - exact).abs().max().item() + 1e-6 * size


def float64_moe(x, tokens, places, ends, scale, keep, w13, w2, shared_w13, shared_w2):
    """The same MoE without rounding."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    x, ends = x.double(), ends.tolist()

    def expert(row, up_weights, down_weights):
        gate, up = (row @ up_weights.double().T).chunk(2)
        return (torch.nn.functional.silu(gate.clamp(max=LIMIT)) * up.clamp(-LIMIT, LIMIT)) @ down_weights.double().T

    for k in range(tokens.shape[0]):
        if keep[k]:
            e = next(g for g, end in enumerate(ends) if places[k] < end)
            out[tokens[k]] += scale[k].double() * expert(x[tokens[k]], w13[e], w2[e])
    if shared_w13 is not None:
        for t in range(x.shape[0]):
            out[t] += expert(x[t], shared_w13, shared_w2)
    return out


def test_one_thread_gives_the_same_bits():
    gate, w13, w2, (shared_w13, shared_w2) = experts_of(0, 8, 512, 256, 256)
    x = torch.randn(13, 512).bfloat16()
    picks = moe.dispatch(x, torch.arange(13), gate, torch.zeros(8), first_expert=0, local_experts=8, top_k=2,
                         scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.0)[1:]
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(cpu_moe.moe_few(x, picks[1], picks[0], *picks[2:], w13, w2, shared_w13, shared_w2,
                                           swiglu_limit=LIMIT))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(*results)


def test_rejects_what_it_cannot_read():
    gate, w13, w2, _ = experts_of(0, 4, 64, 32, 0)
    x = torch.randn(1, 64).bfloat16()
    picks = moe.dispatch(x, torch.arange(1), gate, torch.zeros(4), first_expert=0, local_experts=4, top_k=2,
                         scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.0)[1:]
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        cpu_moe.moe_few(x.double(), picks[1], picks[0], *picks[2:], w13, w2, None, None, swiglu_limit=LIMIT)
    with pytest.raises(RuntimeError, match="weights must be bf16"):
        cpu_moe.moe_few(x, picks[1], picks[0], *picks[2:], w13.float(), w2, None, None, swiglu_limit=LIMIT)
    with pytest.raises(RuntimeError, match="do not fit"):
        cpu_moe.moe_few(x, picks[1], picks[0], *picks[2:], w13, w2.mT, None, None, swiglu_limit=LIMIT)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        cpu_moe.moe_blocks(x[:, :48], picks[1], picks[0], *picks[2:], w13[..., :48], w2[:, :48], None, None,
                           swiglu_limit=LIMIT, tiles=False)


@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("tokens,experts,hidden,top_k,rank,hashed,dtype", [
    (1, 8, 512, 2, None, False, torch.float32), (1, 8, 512, 2, None, True, torch.bfloat16),
    (5, 16, 96, 6, (3, 7), False, torch.bfloat16), (cpu_moe.KERNEL_TOKENS, 64, 48, 4, (32, 32), False, torch.float32),
    (19, 6, 72, 3, (1, 4), True, torch.float32), (3, 4, 40, 4, None, False, torch.float32)])
def test_route_matches_dispatch(scoring_func, tokens, experts, hidden, top_k, rank, hashed, dtype):
    """The C routing and sort: the same picks in the same order, rows and groups as `dispatch` (a rank's
    experts first, its other picks last), and their weights to fp32's precision (the gate's products
    and the score functions round in another order). Logits past softplus' threshold of 20, k = all the
    experts, and picks by token id are among them."""
    g = torch.Generator().manual_seed(tokens * 31 + experts)
    x = (torch.randn(tokens, hidden, generator=g) * 3).to(dtype)
    gate = torch.randn(experts, hidden, generator=g) * hidden**-0.5
    if scoring_func == "sqrtsoftplus":
        gate[0] *= 10  # (expert 0's logits reach past 20)
    token_ids = torch.randint(0, 40, (tokens,), generator=g)
    route = (torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(40)]) if hashed
             else torch.randn(experts, generator=g))
    first, local = rank or (0, experts)
    constants = {"first_expert": first, "local_experts": local, "top_k": top_k, "scoring_func": scoring_func,
                 "norm_topk_prob": top_k != 3, "routed_scaling_factor": 1.5}
    _, *expected = moe.dispatch(x, token_ids, gate, route, **constants)
    got = cpu_moe.route(x, token_ids, gate, route, **constants, group_rows=moe.GROUP_ROWS)
    for name, have, want in zip(("places", "tokens", "ends", "scale", "keep"), got, expected, strict=True):
        assert have.dtype == want.dtype and have.shape == want.shape, name
        if name == "scale":
            assert torch.allclose(have, want, rtol=2e-6, atol=1e-7)
        else:
            assert torch.equal(have, want), name


def test_route_rejects_what_it_cannot_read():
    x, gate = torch.randn(2, 64), torch.randn(4, 64)
    constants = {"first_expert": 0, "local_experts": 4, "top_k": 2, "scoring_func": "sqrtsoftplus",
                 "norm_topk_prob": True, "routed_scaling_factor": 1.0, "group_rows": moe.GROUP_ROWS}
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        cpu_moe.route(x.double(), torch.arange(2), gate, torch.zeros(4), **constants)
    with pytest.raises(RuntimeError, match="do not fit"):
        cpu_moe.route(x, torch.arange(2), gate[:, :32], torch.zeros(4), **constants)
    with pytest.raises(RuntimeError, match="tid2eid"):
        cpu_moe.route(x, torch.arange(2), gate, torch.zeros(4, 3, dtype=torch.long), **constants)
    with pytest.raises(RuntimeError, match="no routing"):
        cpu_moe.route(x, torch.arange(2), gate, torch.zeros(4), **{**constants, "scoring_func": "relu"})


@pytest.mark.parametrize("tiles", [False, True])
@pytest.mark.parametrize("tokens,hashed,dtype,rank", [(1, False, torch.bfloat16, None), (7, True, torch.bfloat16, (2, 4)),
                                                      (cpu_moe.KERNEL_TOKENS, False, torch.float32, None)])
def test_routed_is_route_then_the_kernel(tiles, tokens, hashed, dtype, rank):
    """The one-call decode MoE gives the bits of `route` followed by the kernel."""
    if tiles and (dtype != torch.bfloat16 or not cpu_attention.amx_available()):
        pytest.skip("the tiles run bf16 models on CPUs with AMX")
    gate, w13, w2, shared = experts_of(tokens, 8, 128, 64, 96)
    first, local = rank or (0, 8)
    w13, w2 = w13[first:first + local], w2[first:first + local]
    x = (torch.randn(tokens, 128, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    token_ids = torch.randint(0, 20, (tokens,), generator=torch.Generator().manual_seed(4))
    route = (torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i))[:2] for i in range(20)])
             if hashed else torch.randn(8, generator=torch.Generator().manual_seed(5)))
    constants = {"first_expert": first, "local_experts": local, "top_k": 2, "scoring_func": "sqrtsoftplus",
                 "norm_topk_prob": True, "routed_scaling_factor": 1.5, "group_rows": moe.GROUP_ROWS}
    places, tokens_, ends, scale, keep = cpu_moe.route(x, token_ids, gate, route, **constants)
    kernel = functools.partial(cpu_moe.moe_blocks, tiles=True) if tiles else cpu_moe.moe_few
    expected = kernel(x, tokens_, places, ends, scale, keep, w13, w2, *shared, swiglu_limit=LIMIT)
    got = cpu_moe.routed(x, token_ids, gate, route, w13, w2, *shared, tiles=tiles, **constants, swiglu_limit=LIMIT)
    assert torch.equal(got, expected)
