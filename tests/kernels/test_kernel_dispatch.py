"""The dispatcher: Triton for CUDA tensors, torch otherwise (and always for float64), announced
once per op and path at INFO."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_kernel_compressor import build as build_compressor
from test_kernel_indexer_topk import build as build_indexer
from test_kernel_sparse_attention import build as build_attention

from dsv4.kernels import compressor, dispatch, indexer_topk, sparse_attention

MODULES = {indexer_topk: "indexer_topk", sparse_attention: "sparse_attention", compressor: "compress_insert"}
OPS = tuple(MODULES.values())


def call(op: str, device: str, q_dtype=torch.float32):
    if op == "indexer_topk":
        args, topk = build_indexer("one_row_k1", "fp8", device)
        args[0] = args[0].to(q_dtype)
        return dispatch.indexer_topk(*args, topk)
    if op == "sparse_attention":
        args, kwargs = build_attention("decode_batch", "fp32", "hca", q_dtype, device)
        return dispatch.sparse_attention(*args, **kwargs)
    tensors, cache, pages, rows, kwargs = build_compressor("csa_index_fp32", device)
    return dispatch.compress_insert(*tensors, cache(), pages, rows, **{**kwargs, "model_dtype": q_dtype})


def recording(impl, path: str, paths: list[str]):
    def run(*args, **kwargs):
        paths.append(path)
        return impl(*args, **kwargs)

    return run


@pytest.fixture
def taken(monkeypatch):
    """The paths dispatch calls take, in order (each implementation still runs)."""
    paths: list[str] = []
    monkeypatch.setattr(dispatch, "_announced", set())
    for module, op in MODULES.items():
        for path in ("triton", "torch"):
            name = f"{op}_{path}"
            monkeypatch.setattr(module, name, recording(getattr(module, name), path, paths))
    return paths


@pytest.mark.parametrize("op", OPS)
def test_picks_by_device_and_announces_once(op, device, taken, caplog):
    with caplog.at_level(logging.INFO, logger="dsv4.kernels.dispatch"):
        call(op, device)
        call(op, device)
    expected = "triton" if device == "cuda" else "torch"
    assert taken == [expected, expected]
    announcements = [r.getMessage() for r in caplog.records if r.name == "dsv4.kernels.dispatch"]
    assert announcements == [f"{op}: {expected} path ({device} tensors)"]


@pytest.mark.parametrize("op", OPS)
def test_float64_takes_the_torch_path(op, device, taken):
    call(op, device, torch.float64)
    assert taken == ["torch"]


def test_importing_the_dispatcher_does_not_import_triton():
    """The model imports the dispatcher; Triton must wait for an op's first call (conftest.py)."""
    probe = "import sys, dsv4.kernels.dispatch; sys.exit('triton' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).parents[2], timeout=120,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr or "importing dsv4.kernels.dispatch imported triton"
