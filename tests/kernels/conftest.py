"""Kernel tests compile the Triton kernels for real on a CUDA device, and otherwise run them under
Triton's CPU interpreter, which the root tests/conftest.py switches on before anything imports Triton.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


@pytest.fixture
def device() -> str:
    return "cuda" if ON_CUDA else "cpu"
