"""Session-wide setup: Triton's CPU interpreter when there is no GPU, and tiny random checkpoints
built once per test session.

Triton reads TRITON_INTERPRET when it is first imported, so it is set here, before any test module
(or the library code it imports) can import Triton. DSV4_KERNELS_INTERPRET=1 forces the interpreter
on a GPU machine too.
"""

import contextlib
import os

import pytest
import torch

# Compiling costs tens of seconds per process: only the tests about the compiled path ask for it
# (`ServerArgs(disable_compile=False)`); every other model, and every server a test starts, runs eagerly.
os.environ["DSV4_DISABLE_COMPILE"] = "1"

KERNELS_ON_CUDA = torch.cuda.is_available() and os.environ.get("DSV4_KERNELS_INTERPRET") != "1"
if not KERNELS_ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from hypothesis import settings

from dsv4.tiny import make_tiny

# Property tests draw the same examples on every run (CI included) unless `--hypothesis-seed N`
# asks for another draw; no example database, so a run depends on nothing left on disk.
settings.register_profile("fixed", derandomize=True, database=None, deadline=None)
settings.register_profile("seeded", database=None, deadline=None)


def pytest_configure(config):
    settings.load_profile("fixed" if config.getoption("hypothesis_seed", None) is None else "seeded")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Test tensors are small: intra-op threads gain nothing, and on shared cores idle ones spin.
    Servers that tests start run in their own processes with their own setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def torch_threads():
    """`with torch_threads(n):` runs a block under n torch threads, then restores the count: a runner
    built under 2 takes 2 as "every core" (the session's one thread would leave its choices equal)."""
    @contextlib.contextmanager
    def under(count: int):
        threads = torch.get_num_threads()
        torch.set_num_threads(count)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    return under


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """A `tiny` preset checkpoint directory in bf16 (seed 0)."""
    return make_tiny(tmp_path_factory.mktemp("tiny-bf16"), preset="tiny", fmt="bf16")


@pytest.fixture(scope="session")
def tiny_ckpt_fp8(tmp_path_factory):
    """The same weights stored as DeepSeek ships them: FP8 block-scaled, routed experts FP4."""
    return make_tiny(tmp_path_factory.mktemp("tiny-fp8"), preset="tiny", fmt="fp8")
