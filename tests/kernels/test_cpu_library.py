"""The C kernels build wherever they can run. Every C kernel test skips where `available()` is False (a CPU
without AVX512-BF16, or no compiler), so on a CPU that has it a build that fails (a compile error in
dsv4/kernels/cpu/) must fail here rather than leave those tests skipped."""

from __future__ import annotations

import shutil

import pytest

from dsv4.config.server_args import cpu_has_avx512_bf16
from dsv4.kernels import cpu_library


def test_the_kernels_build_where_the_cpu_runs_them():
    if not cpu_has_avx512_bf16() or not (shutil.which("gcc") or shutil.which("cc")):
        pytest.skip("this CPU has no AVX512-BF16, or there is no C compiler: the model runs torch ops")
    assert cpu_library.available(), "the AVX512-BF16 kernels did not build: the log says why"
