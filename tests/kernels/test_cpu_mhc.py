"""The mHC mix kernel (dsv4/kernels/cpu_mhc.py) against the model's torch code (dsv4.model.mhc.mix,
which the model tests hold against the reference) and float64."""

import pytest
import torch

from dsv4.kernels import cpu_mhc
from dsv4.model import mhc

pytestmark = pytest.mark.skipif(not cpu_mhc.available(), reason="the CPU kernels do not run here (no AVX512-BF16 or AVX2, or no C compiler)")

CONSTANTS = {"sinkhorn_iters": 20, "hc_eps": 1e-6, "norm_eps": 1e-6}


def inputs_of(seed: int, tokens: int, n: int, hidden: int, dtype: torch.dtype, spread: float = 1.0):
    """A layer's mix inputs: streams and output in `dtype`, the rest fp32; `spread` scales the mixing
    projection (the logits of the gates and of the Sinkhorn's softmax)."""
    g = torch.Generator().manual_seed(seed)
    mixes = (2 + n) * n
    streams = (torch.randn(tokens, n, hidden, generator=g) * 2).to(dtype)
    output = torch.randn(tokens, hidden, generator=g).to(dtype)
    post = torch.rand(tokens, n, generator=g) * 2
    comb = torch.rand(tokens, n, n, generator=g)
    fn = torch.randn(mixes, n * hidden, generator=g) * (n * hidden) ** -0.5 * spread
    base = torch.randn(mixes, generator=g)
    scale = torch.rand(3, generator=g).repeat_interleave(torch.tensor([n, n, n * n]))  # as HyperConnection repeats it
    norm = torch.rand(hidden, generator=g) + 0.5
    return streams, output, post, comb, fn, base, scale, norm


@pytest.mark.parametrize("tokens,n,hidden,dtype,spread", [
    (1, 4, 512, torch.float32, 1.0), (7, 4, 64, torch.bfloat16, 1.0), (33, 4, 40, torch.float32, 1.0),
    (5, 3, 512, torch.bfloat16, 1.0), (9, 8, 48, torch.float32, 1.0), (6, 4, 96, torch.float32, 30.0),
    (130, 4, 512, torch.bfloat16, 30.0)])
def test_matches_mix(tokens, n, hidden, dtype, spread):
    """Token counts off the kernel's groups of 4, widths off its 16 lanes, n = 4 (its vector Sinkhorn)
    and other n (its scalar one), and logits spread wide enough that the softmaxes saturate."""
    args = inputs_of(tokens * 31 + hidden, tokens, n, hidden, dtype, spread)
    got = cpu_mhc.mix(*args, n=n, **CONSTANTS)
    want = mhc.mix(*args, n=n, **CONSTANTS)
    exact = mhc.mix(*(t.double() for t in args), n=n, **CONSTANTS)
    for name, g, w, e in zip(("streams", "x", "post", "comb"), got, want, exact, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        size = e.abs().max().item()
        if dtype == torch.bfloat16 and name in ("streams", "x"):
            # rounded into bf16 in both from fp32 sums in another order: one bf16 rounding apart at most
            # (of x's collapse sum before its norm, where the streams' terms may cancel: against the size)
            assert ((g.double() - w.double()).abs() <= 2**-7 * w.double().abs() + 2**-9 * size).all(), name
            assert (g == w).float().mean().item() > 0.99, name
        else:
            # fp32 arithmetic in another order: as close to float64 as the torch code is, within a few ulp
            assert (g.double() - e).abs().max().item() <= 4 * (w.double() - e).abs().max().item() + 1e-6 * size, name


@pytest.mark.parametrize("tokens,dtype", [(37, torch.bfloat16), (1, torch.float32), (3, torch.bfloat16)])
def test_one_thread_equals_two(tokens, dtype):
    """The same bits on one thread and on two: with fewer groups of four tokens than threads (1 and 3
    tokens on two), the two split the mixes' logits by blocks of mixes, where one takes whole groups."""
    args = inputs_of(3, tokens, 4, 512, dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_mhc.mix(*args, n=4, **CONSTANTS)
        torch.set_num_threads(2)
        two = cpu_mhc.mix(*args, n=4, **CONSTANTS)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_mixes_alike_in_any_group(dtype):
    """Each token's bits are the same whether it is mixed alone, in a pair or in a group of four (the kernel
    sums one token's, two tokens' or four tokens' logits at once, in runs of as many mixes as fit the
    registers): 7 tokens (a group of four and a short one of three) against each one alone, and pairs."""
    args = inputs_of(11, 7, 4, 512, dtype)
    together = cpu_mhc.mix(*args, n=4, **CONSTANTS)
    for first, count in [(i, 1) for i in range(7)] + [(0, 2), (4, 2), (5, 2)]:
        part = cpu_mhc.mix(*(t[first:first + count] for t in args[:4]), *args[4:], n=4, **CONSTANTS)
        for name, a, b in zip(("streams", "x", "post", "comb"), part, together, strict=True):
            assert torch.equal(a, b[first:first + count]), (name, first, count)


def test_refuses_what_it_cannot_compute():
    assert cpu_mhc.serves(torch.float32, torch.device("cpu"), 4)
    assert not cpu_mhc.serves(torch.float64, torch.device("cpu"), 4)
    assert not cpu_mhc.serves(torch.bfloat16, torch.device("cpu"), cpu_mhc.MAX_STREAMS + 1)
    assert not cpu_mhc.serves(torch.bfloat16, torch.device("meta"), 4)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        cpu_mhc.mix(*(t.double() for t in inputs_of(1, 2, 4, 32, torch.float32)), n=4, **CONSTANTS)
    with pytest.raises(RuntimeError, match="at most"):
        n = cpu_mhc.MAX_STREAMS + 1
        cpu_mhc.mix(*inputs_of(1, 2, n, 32, torch.float32), n=n, **CONSTANTS)
    streams, *rest = inputs_of(1, 2, 4, 32, torch.float32)
    with pytest.raises(RuntimeError, match="do not fit"):
        cpu_mhc.mix(streams[:, :3], *rest, n=4, **CONSTANTS)
