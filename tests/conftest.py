"""Session-wide fixtures: tiny random checkpoints, built once per test session."""

import pytest

from dsv4.tiny import make_tiny


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """A `tiny` preset checkpoint directory in bf16 (seed 0)."""
    return make_tiny(tmp_path_factory.mktemp("tiny-bf16"), preset="tiny", fmt="bf16")


@pytest.fixture(scope="session")
def tiny_ckpt_fp8(tmp_path_factory):
    """The same weights stored as DeepSeek ships them: FP8 block-scaled, routed experts FP4."""
    return make_tiny(tmp_path_factory.mktemp("tiny-fp8"), preset="tiny", fmt="fp8")
