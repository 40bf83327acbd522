"""The decode steps' projection kernels (dsv4/kernels/cpu_project.py) against the model's torch code
(dsv4.model.attention.project_inputs and attention_exit, which the model tests hold against the
reference) and float64."""

import pytest
import torch

from dsv4.kernels import cpu_project
from dsv4.model import attention
from dsv4.model.ops import linear, rms_norm, rotate_

pytestmark = pytest.mark.skipif(not cpu_project.available(), reason="the CPU kernels do not run here (no AVX512-BF16 or AVX2, or no C compiler)")

# (tokens, hidden, width of w_input, q_lora_rank, head_dim, heads, RoPE dims, wo groups, o_lora_rank):
# small's shapes; widths off the kernels' 16 and 32 lanes; a window layer's input (no compressor part)
SHAPES = [(1, 512, 3392, 256, 512, 16, 64, 4, 128), (3, 72, 200, 40, 48, 3, 16, 3, 24),
          (cpu_project.KERNEL_TOKENS, 64, 96, 32, 64, 4, 8, 2, 16)]


def tables(tokens: int, rope: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved RoPE tables as ops.Rope lays them out, at arbitrary angles."""
    angles = torch.rand(tokens, rope // 2, generator=g) * 6.3
    return angles.cos().repeat_interleave(2, -1), torch.stack([-angles.sin(), angles.sin()], -1).flatten(-2)


def assert_close(got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, name: str):
    assert got.dtype == want.dtype and got.shape == want.shape, name
    size = exact.abs().max().item()
    if dtype == torch.bfloat16:  # rounded into bf16 in both from fp32 sums in another order
        assert ((got.double() - want.double()).abs() <= 2**-7 * want.double().abs() + 2**-9 * size).all(), name
        assert (got == want).float().mean().item() > 0.9, name
    else:  # fp32 arithmetic in another order: as close to float64 as the torch code, within a few ulp
        assert (got.double() - exact).abs().max().item() <= 4 * (want.double() - exact).abs().max().item() + 1e-6 * size, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_project_matches_project_inputs(shape, dtype):
    """bf16 weights (an fp32 model's are its weights' bf16 copies, which hold the same values)."""
    tokens, hidden, width, q_rank, dim, heads, rope, _, _ = shape
    g = torch.Generator().manual_seed(tokens + hidden)
    w_input = (torch.randn(width, hidden, generator=g) * hidden**-0.5).bfloat16()
    wq_b = (torch.randn(heads * dim, q_rank, generator=g) * q_rank**-0.5).bfloat16()
    q_norm, kv_norm = torch.rand(q_rank, generator=g) + 0.5, torch.rand(dim, generator=g) + 0.5
    x = (torch.randn(tokens, hidden, generator=g) * 2).to(dtype)
    cos2, sin2 = tables(tokens, rope, g)
    got = cpu_project.project(x, w_input, q_norm, wq_b, kv_norm, cos2, sin2, eps=1e-6)
    want = attention.project_inputs(x, w_input.to(dtype), q_norm, wq_b.to(dtype), kv_norm, cos2, sin2, eps=1e-6)
    exact = attention.project_inputs(*(t.double() for t in (x, w_input, q_norm, wq_b, kv_norm, cos2, sin2)), eps=1e-6)
    for name, *parts in zip(("q", "kv", "qr", "projected"), got, want, exact, strict=True):
        assert_close(*parts, dtype, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_exit_matches_attention_exit(shape, dtype):
    tokens, hidden, _, _, dim, heads, rope, groups, o_rank = shape
    g = torch.Generator().manual_seed(tokens * 3 + dim)
    span = heads // groups * dim
    wo_a = (torch.randn(groups, o_rank, span, generator=g) * span**-0.5).bfloat16()
    wo_b = (torch.randn(hidden, groups * o_rank, generator=g) * (groups * o_rank) ** -0.5).bfloat16()
    out = torch.randn(tokens, heads, dim, generator=g).to(dtype)
    cos2, sin2 = tables(tokens, rope, g)
    got = cpu_project.exit(out.clone(), cos2, sin2, wo_a, wo_b)
    want = attention.attention_exit(out.clone(), cos2, sin2, wo_a.to(dtype), wo_b.to(dtype))
    exact = attention.attention_exit(*(t.double() for t in (out, cos2, sin2, wo_a, wo_b)))
    assert_close(got, want, exact, dtype, "exit")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,weighted,normed,inverse", [
    ((37, 16, 512), False, True, False), ((5, 48), True, True, False), ((9, 3, 40), False, False, True),
    ((600, 2, 64), True, True, False)])
def test_norm_rope_matches_rms_norm_then_rotate(shape, weighted, normed, inverse, dtype):
    """A prefill's rows in place: the queries' heads (no weight), raw rows (a weight), the attention
    output rotated back (no norm); widths off the 16 lanes; more rows than threads' shares."""
    g = torch.Generator().manual_seed(shape[0])
    rows = (torch.randn(*shape, generator=g) * 3).to(dtype)
    weight = torch.rand(shape[-1], generator=g) + 0.5 if weighted else None
    cos2, sin2 = tables(shape[0], 16, g)

    def reference(x, *tables):
        return rotate_(rms_norm(x, weight, 1e-6) if normed else x.clone(), *tables, inverse)
    got = cpu_project.norm_rope(rows.clone(), weight, cos2, sin2, eps=1e-6 if normed else None, inverse=inverse)
    assert_close(got, reference(rows, cos2, sin2), reference(rows.double(), cos2.double(), sin2.double()), dtype, "rows")


def test_one_thread_equals_two():
    g = torch.Generator().manual_seed(1)
    w_input, wq_b = torch.randn(200, 72, generator=g).bfloat16(), torch.randn(3 * 48, 40, generator=g).bfloat16()
    x, (cos2, sin2) = torch.randn(5, 72, generator=g).bfloat16(), tables(5, 16, g)
    norms = torch.rand(40, generator=g) + 0.5, torch.rand(48, generator=g) + 0.5
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(cpu_project.project(x, w_input, norms[0], wq_b, norms[1], cos2, sin2, eps=1e-6))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_refuses_what_it_cannot_compute():
    g = torch.Generator().manual_seed(2)
    wo_a, wo_b = torch.randn(2, 16, 128, generator=g).bfloat16(), torch.randn(64, 32, generator=g).bfloat16()
    out, (cos2, sin2) = torch.randn(2, 4, 64, generator=g), tables(2, 8, g)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        cpu_project.exit(out.double(), cos2, sin2, wo_a, wo_b)
    with pytest.raises(RuntimeError, match="weights must be bf16"):
        cpu_project.exit(out, cos2, sin2, wo_a.float(), wo_b)
    with pytest.raises(RuntimeError, match="do not fit"):
        cpu_project.exit(out, cos2, sin2, wo_a[:, :, :64], wo_b)
    many = cpu_project.KERNEL_TOKENS + 1
    with pytest.raises(RuntimeError, match="at most"):
        cpu_project.exit(torch.randn(many, 4, 64), *tables(many, 8, g), wo_a, wo_b)
    qr, wq_b = torch.randn(2, 32, generator=g), torch.randn(4 * 16, 32, generator=g).bfloat16()
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_project.index_queries(qr, wq_b[:, :16], cos2, sin2, head_dim=16)
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_project.index_queries(qr, wq_b, cos2, sin2, head_dim=24)
    with pytest.raises(RuntimeError, match="at most"):
        cpu_project.index_queries(torch.randn(many, 32), wq_b, *tables(many, 8, g), head_dim=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,q_rank,heads,dim,rope", [(1, 256, 64, 128, 64), (3, 40, 3, 48, 16),
                                                          (cpu_project.KERNEL_TOKENS, 72, 5, 32, 8)])
def test_index_queries_match_index_queries(tokens, q_rank, heads, dim, rope, dtype):
    """The indexer's queries (small's shapes first; others off the kernels' lanes) against
    dsv4.model.attention.index_queries and float64; its head weights stay torch's."""
    g = torch.Generator().manual_seed(tokens + q_rank)
    wq_b = (torch.randn(heads * dim, q_rank, generator=g) * q_rank**-0.5).bfloat16()
    qr = torch.randn(tokens, q_rank, generator=g).to(dtype)
    cos2, sin2 = tables(tokens, rope, g)
    weights = torch.zeros(tokens, heads)
    got = cpu_project.index_queries(qr, wq_b, cos2, sin2, head_dim=dim)
    want, _ = attention.index_queries(qr, weights, wq_b.to(dtype), cos2, sin2, head_dim=dim, scale=1.0)
    exact, _ = attention.index_queries(*(t.double() for t in (qr, weights, wq_b, cos2, sin2)), head_dim=dim, scale=1.0)
    assert_close(got, want, exact, dtype, "index queries")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden,vocab", [(1, 512, 512), (3, 72, 200), (cpu_project.KERNEL_TOKENS, 64, 129)])
def test_logits_match_the_head_product(rows, hidden, vocab, dtype):
    """The LM head's product (small's shapes first; others off the kernels' lanes) against the model's,
    `linear(x, head).float()`, and float64."""
    g = torch.Generator().manual_seed(rows + hidden)
    head = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).bfloat16()
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    got = cpu_project.logits(x, head)
    want = linear(x, head.to(dtype)).float()
    assert_close(got, want, x.double() @ head.double().T, dtype, "logits")


def test_logits_refuse_what_they_cannot_compute():
    x, head = torch.randn(2, 64), torch.randn(100, 64).bfloat16()
    with pytest.raises(RuntimeError, match="weights must be bf16"):
        cpu_project.logits(x, head.float())
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_project.logits(x, head[:, :32])
    with pytest.raises(RuntimeError, match="at most"):
        cpu_project.logits(torch.randn(cpu_project.KERNEL_TOKENS + 1, 64), head)
