"""Configuration, and the only place in dsv4 that reads env vars.

- `model.py`: ModelConfig read from a checkpoint's config.json, the tensors it implies, cache_dir().
- `server_args.py`: ServerArgs, everything `python -m dsv4 serve` is told.
- `faults.py`: the test-only `--fault-inject` grammar.
"""

from dsv4.config.faults import FRAME_KINDS, CopyDelay, FaultInjection, FrameFault, RankDelay, parse_duration
from dsv4.config.model import (
    CSA,
    HCA,
    LAYER_KIND_BY_RATIO,
    WINDOW,
    ConfigError,
    ModelConfig,
    YarnScaling,
    cache_dir,
    compile_disabled_by_env,
    expected_weights,
)
from dsv4.config.server_args import DTYPE_CHOICES, DTYPES, ServerArgs

__all__ = [
    "CSA", "DTYPES", "DTYPE_CHOICES", "FRAME_KINDS", "HCA", "LAYER_KIND_BY_RATIO", "WINDOW", "ConfigError", "CopyDelay",
    "FaultInjection", "FrameFault", "ModelConfig", "RankDelay", "ServerArgs", "YarnScaling", "cache_dir",
    "compile_disabled_by_env", "expected_weights", "parse_duration",
]
