"""The C kernels build wherever they can run. Every C kernel test skips where `available()` is False (a CPU
with neither AVX512-BF16 nor AVX2, or no compiler), so on a CPU that has one a build that fails (a compile
error in dsv4/kernels/cpu/) must fail here rather than leave those tests skipped."""

from __future__ import annotations

import shutil

import pytest

from dsv4.config.server_args import cpu_kernel_isa
from dsv4.kernels import cpu_library


def test_the_kernels_build_where_the_cpu_runs_them():
    if cpu_kernel_isa() is None or not (shutil.which("gcc") or shutil.which("cc")):
        pytest.skip("this CPU has neither AVX512-BF16 nor AVX2, or there is no C compiler: the model runs torch ops")
    assert cpu_library.available(), f"the {cpu_kernel_isa()} kernels did not build: the log says why"


@pytest.mark.parametrize("isa", cpu_library.ISAS)
def test_the_kernels_build_for_every_isa(isa, tmp_path):
    """The builds share their sources (cpu/simd.h: the AVX-512 intrinsics, or AVX2 pairs in their place), so a
    change made and tested on one CPU must still build for the others: each builds here, whatever this CPU
    runs."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    library = tmp_path / f"kernels-{isa}.so"
    cpu_library.build(isa, library, compiler)
    assert library.stat().st_size > 0
