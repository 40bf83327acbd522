"""The kernels' entry points: Triton on CUDA tensors, the vectorised torch path everywhere else.

float64 (the oracle dtype) and fp64 rows always take the torch path. Each op logs the path it
takes once, at INFO, the first time it takes it. Arguments are documented on each op's torch path
(`*_torch` in the op's module); both paths run the same argument checks.

The op modules, and Triton with them, are imported at an op's first call rather than with this
module: importing the model does not import Triton, so a test session can still switch Triton's
CPU interpreter on (TRITON_INTERPRET is read when Triton is imported) after collecting modules
that import the model.
"""

from __future__ import annotations

import importlib
import logging

import torch

log = logging.getLogger(__name__)
_announced: set[tuple[str, str]] = set()


def _op_module(name: str):
    return importlib.import_module(f"{__package__}.{name}")


def _use_triton(op: str, tensor: torch.Tensor, triton_supported: bool) -> bool:
    triton_path = tensor.is_cuda and triton_supported
    path = "triton" if triton_path else "torch"
    if (op, path) not in _announced:
        _announced.add((op, path))
        log.info("%s: %s path (%s tensors)", op, path, tensor.device.type)
    return triton_path


def indexer_topk(q, weights, index_keys, key_format, page_table, token_req, positions, topk) -> torch.Tensor:
    """int32 [T, topk]: each query token's best visible index-key rows, best first, -1 padded."""
    op = _op_module("indexer_topk")
    triton_path = _use_triton("indexer_topk", q, q.dtype != torch.float64)
    impl = op.indexer_topk_triton if triton_path else op.indexer_topk_torch
    return impl(q, weights, index_keys, key_format, page_table, token_req, positions, topk)


def sparse_attention(q, sink, new_rows, window, token_req, positions, req_slots, req_starts, *, row_format,
                     compressed=None, page_table=None, ratio=0, selected=None, rope_dim=64) -> torch.Tensor:
    """[T, H, D] attention output in q's dtype (before the inverse RoPE of the output)."""
    op = _op_module("sparse_attention")
    triton_path = _use_triton("sparse_attention", q, row_format in op.TRITON_FORMATS and q.dtype != torch.float64)
    impl = op.sparse_attention_triton if triton_path else op.sparse_attention_torch
    return impl(q, sink, new_rows, window, token_req, positions, req_slots, req_starts, row_format=row_format,
                compressed=compressed, page_table=page_table, ratio=ratio, selected=selected, rope_dim=rope_dim)


def compress_insert(state, units, first_rows, windows, cos, sin, norm_weight, cache, pages, rows, *, ratio,
                    row_format, eps, model_dtype) -> None:
    """Pool, norm, rotate and quantise one compressed row per entry into cache[pages[n], rows[n]]."""
    op = _op_module("compressor")
    supported = row_format != "fp64" and model_dtype != torch.float64 and state.dtype != torch.float64
    impl = op.compress_insert_triton if _use_triton("compress_insert", state, supported) else op.compress_insert_torch
    impl(state, units, first_rows, windows, cos, sin, norm_weight, cache, pages, rows, ratio=ratio,
         row_format=row_format, eps=eps, model_dtype=model_dtype)
