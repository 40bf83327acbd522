"""The attention's projections of a decode step's few tokens as C kernels (cpu/project.c; AVX512-BF16 or AVX2),
for a bf16 model or an fp32 one whose weights hold bf16 values (read from bf16 copies, widened exactly
as they are read): every weight read once where it lies against all of the tokens, the norms and
rotations done while the rows are in cache, rounded where the torch code rounds.
- `project`: dsv4.model.attention.project_inputs;
- `exit`: dsv4.model.attention.attention_exit;
- `norm_rope`: for a prefill's tokens, the per-row norms and RoPE that follow project_inputs' products;
- `index_queries`: dsv4.model.attention.index_queries' queries;
- `logits`: the LM head's product (dsv4.model.model.PagedModel.forward's last).
Their oracles are those functions (their tests run both against float64)."""

from __future__ import annotations

import ctypes

import torch

from .cpu_library import as_read, available, entry

__all__ = ["KERNEL_TOKENS", "available", "exit", "index_queries", "logits", "norm_rope", "project"]

KERNEL_TOKENS = 8  # cpu/dots.h's BLOCK: the most rows that share each load of a weight
_DTYPES = (torch.float32, torch.bfloat16)


def project(x: torch.Tensor, w_input: torch.Tensor, q_norm: torch.Tensor, wq_b: torch.Tensor, kv_norm: torch.Tensor,
            cos2: torch.Tensor, sin2: torch.Tensor, *, eps: float) -> tuple[torch.Tensor, ...]:
    """`project_inputs` of x [T, hidden] (fp32 or bf16, T <= KERNEL_TOKENS): w_input [width, hidden] and
    wq_b [heads * head_dim, q_lora_rank] bf16, q_norm [q_lora_rank] and kv_norm [head_dim] fp32, the RoPE
    tables cos2, sin2 [T, R] fp32 -> (q [T, heads, head_dim], kv [T, head_dim], qr [T, q_lora_rank],
    projected [T, width]) in x's dtype."""
    tokens, hidden = x.shape
    width, q_rank, dim, rope = w_input.shape[0], q_norm.shape[0], kv_norm.shape[0], cos2.shape[-1]
    heads = wq_b.shape[0] // dim
    _check("project", x, [w_input, wq_b], [q_norm, kv_norm, cos2, sin2], rope, dim)
    if w_input.shape != (width, hidden) or wq_b.shape != (heads * dim, q_rank) or width < q_rank + dim:
        raise RuntimeError(f"cpu project: w_input {tuple(w_input.shape)} and wq_b {tuple(wq_b.shape)} do not fit "
                           f"x {tuple(x.shape)}, q_norm {tuple(q_norm.shape)} and kv_norm {tuple(kv_norm.shape)}")
    inputs = [as_read(t) for t in (x, w_input, q_norm, wq_b, kv_norm, cos2, sin2)]
    q, kv = x.new_empty(tokens, heads, dim), x.new_empty(tokens, dim)
    qr, projected = x.new_empty(tokens, q_rank), x.new_empty(tokens, width)
    params = project_params(tokens, hidden, width, q_rank, dim, heads, rope, x.dtype)
    _run("decode_project", inputs, (q, kv, qr, projected), params, eps)
    return q, kv, qr, projected


def project_params(tokens: int, hidden: int, width: int, q_rank: int, dim: int, heads: int, rope: int,
                   dtype: torch.dtype) -> tuple[int, ...]:
    """decode_project's p[] (cpu/project.c's J_*)."""
    return tokens, hidden, width, q_rank, dim, heads, rope, dtype == torch.float32


def exit_params(tokens: int, heads: int, dim: int, groups: int, o_rank: int, hidden: int, rope: int,
                dtype: torch.dtype) -> tuple[int, ...]:
    """decode_exit's p[] (cpu/project.c's X_*)."""
    return tokens, heads, dim, groups, o_rank, hidden, rope, dtype == torch.float32


def exit(out: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, wo_a: torch.Tensor,
         wo_b: torch.Tensor) -> torch.Tensor:
    """`attention_exit` of the attention's output out [T, heads, head_dim] (fp32 or bf16, T <=
    KERNEL_TOKENS; ours to overwrite: rotated back in place), the RoPE tables cos2, sin2 [T, R] fp32,
    wo_a [groups, o_lora_rank, heads / groups * head_dim] and wo_b [hidden, groups * o_lora_rank] bf16
    -> [T, hidden] in out's dtype."""
    tokens, heads, dim = out.shape
    groups, o_rank, span = wo_a.shape
    hidden, rope = wo_b.shape[0], cos2.shape[-1]
    _check("exit", out, [wo_a, wo_b], [cos2, sin2], rope, dim)
    if heads % groups or span != heads // groups * dim or wo_b.shape[1] != groups * o_rank:
        raise RuntimeError(f"cpu exit: wo_a {tuple(wo_a.shape)} and wo_b {tuple(wo_b.shape)} do not fit "
                           f"out {tuple(out.shape)}")
    if not out.is_contiguous():
        raise RuntimeError("cpu exit: out must be contiguous (it is rotated back in place)")
    inputs = [out, *(as_read(t) for t in (cos2, sin2, wo_a, wo_b))]
    result = out.new_empty(tokens, hidden)
    _run("decode_exit", inputs, (result,), exit_params(tokens, heads, dim, groups, o_rank, hidden, rope, out.dtype),
         None)
    return result


def index_queries(qr: torch.Tensor, wq_b: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, *,
                  head_dim: int) -> torch.Tensor:
    """The indexer's queries of `index_queries`: qr [T, q_lora_rank] (fp32 or bf16, T <= KERNEL_TOKENS)
    times wq_b [heads * head_dim, q_lora_rank] bf16, each head's last R dims rotated by the RoPE tables
    cos2, sin2 [T, R] fp32 -> [T, heads, head_dim] in qr's dtype."""
    tokens, q_rank = qr.shape
    _check("index_queries", qr, [wq_b], [cos2, sin2], cos2.shape[-1], head_dim)
    if wq_b.dim() != 2 or wq_b.shape[1] != q_rank or wq_b.shape[0] % head_dim:
        raise RuntimeError(f"cpu index_queries: wq_b {tuple(wq_b.shape)} does not fit qr {tuple(qr.shape)} and "
                           f"head_dim {head_dim}")
    heads = wq_b.shape[0] // head_dim
    q = qr.new_empty(tokens, heads, head_dim)
    params = (tokens, q_rank, heads, head_dim, cos2.shape[-1], qr.dtype == torch.float32)
    _run("decode_index_queries", [as_read(t) for t in (qr, wq_b, cos2, sin2)], (q,), params, None)
    return q


def logits(x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """x [T, hidden] (fp32 or bf16, T <= KERNEL_TOKENS) times head [vocab, hidden] bf16 -> fp32 logits [T,
    vocab]: `linear(x, head).float()`, each product rounded into x's dtype."""
    tokens, hidden = x.shape
    _check("logits", x, [head], [], 0, hidden)
    if head.dim() != 2 or head.shape[1] != hidden:
        raise RuntimeError(f"cpu logits: head {tuple(head.shape)} does not fit x {tuple(x.shape)}")
    out = torch.empty(tokens, head.shape[0])
    _run("decode_logits", [as_read(x), as_read(head)], (out,), logits_params(tokens, hidden, head.shape[0], x.dtype), None)
    return out


def logits_params(tokens: int, hidden: int, vocab: int, dtype: torch.dtype) -> tuple[int, ...]:
    """decode_logits' p[] (cpu/project.c's H_*)."""
    return tokens, hidden, vocab, dtype == torch.float32


def norm_rope(rows: torch.Tensor, weight: torch.Tensor | None, cos2: torch.Tensor, sin2: torch.Tensor, *,
              eps: float | None, inverse: bool = False) -> torch.Tensor:
    """rows [T, heads, dim] or [T, dim] (fp32 or bf16, contiguous) RMS-normed (times weight [dim] fp32,
    unless None; eps None: not normed) and their last R dims rotated by the RoPE tables cos2, sin2 [T, R]
    fp32 (backwards with `inverse`), in place, as `rotate_(rms_norm(rows, weight, eps), cos2, sin2,
    inverse)` rounds; returns rows."""
    tokens, dim = rows.shape[0], rows.shape[-1]
    heads = rows.shape[1] if rows.dim() == 3 else 1
    tables = [*([] if weight is None else [weight]), cos2, sin2]
    _check("norm_rope", rows, [], tables, cos2.shape[-1], dim, few=False)
    if not rows.is_contiguous() or rows.dim() not in (2, 3) or (weight is not None and weight.shape != (dim,)):
        raise RuntimeError(f"cpu norm_rope: rows {tuple(rows.shape)} must be contiguous [T, heads, dim] or [T, dim] "
                           f"and the weight [dim]")
    params = (tokens, heads, dim, cos2.shape[-1], rows.dtype == torch.float32, eps is not None, inverse)
    _run("norm_rope", [rows, weight, as_read(cos2), as_read(sin2)], (), params, eps or 0.0)
    return rows


def _check(name: str, x: torch.Tensor, weights: list[torch.Tensor], fp32: list[torch.Tensor], rope: int, dim: int,
           *, few: bool = True) -> None:
    """Refuses what the kernel `name` cannot compute (`few`: at most KERNEL_TOKENS tokens, x's rows)."""
    tokens, problems = x.shape[0], []
    if x.device.type != "cpu" or x.dtype not in _DTYPES:
        problems.append(f"activations must be fp32 or bf16 on the CPU (got {x.dtype} on {x.device})")
    if few and tokens > KERNEL_TOKENS:
        problems.append(f"at most {KERNEL_TOKENS} tokens (got {tokens})")
    if any(w.dtype != torch.bfloat16 for w in weights):
        problems.append("the weights must be bf16")
    if any(t.dtype != torch.float32 for t in fp32):
        problems.append("the norms and RoPE tables must be fp32")
    if rope % 2 or rope > dim or any(t.shape != (tokens, rope) for t in fp32[-2:]):
        problems.append(f"the RoPE tables must be [tokens, an even number of dims up to {dim}]")
    if problems:
        raise RuntimeError(f"cpu {name}: " + "; ".join(problems))


def _run(name: str, inputs: list[torch.Tensor | None], outputs: tuple[torch.Tensor, ...], params: tuple,
         eps: float | None) -> None:
    floats = () if eps is None else (eps,)
    status = entry(name)(*(None if t is None else t.data_ptr() for t in (*inputs, *outputs)),
                         (ctypes.c_int64 * len(params))(*params), *floats, torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"cpu {name}: the kernel could not allocate its scratch memory")
