"""Checkpoints on disk, read by `load_reference_model`, against HF transformers on the same weights.

Two sources: a random HF model saved in official names as bf16 and as FP8/FP4, and the
checkpoints `make-tiny` writes. HF reads the decoded weights through its own loader
(`from_pretrained` on a bf16 checkpoint in official names, mapped by transformers' own
conversion rules); FP8 and FP4 values times power-of-two scales are exact in bf16, so that
checkpoint holds exactly what the FP8/FP4 files decode to.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV4ForCausalLM

from dsv4.config import ModelConfig
from dsv4.reference import load_reference_model
from dsv4.weights import save_checkpoint, storage_roundtrip
from tests.hf_oracle import build_hf_model, hf_logits, model_config, official_state_dict, relative_error

PROMPT_LENGTHS = (1, 3, 4, 5, 127, 128, 129, 300)
TOLERANCE = 1e-4


def hf_from_official(directory, cfg: ModelConfig, state_dict) -> DeepseekV4ForCausalLM:
    save_checkpoint(directory, cfg, state_dict, fmt="bf16")
    return DeepseekV4ForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def assert_reference_matches_hf(checkpoint, hf_model, vocab_size: int) -> None:
    reference = load_reference_model(checkpoint, dtype=torch.float32)
    for length in PROMPT_LENGTHS:
        input_ids = torch.randint(0, vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        error = relative_error(reference(input_ids), hf_logits(hf_model, input_ids))
        assert error < TOLERANCE, f"{length} tokens: relative error {error:.2e}"


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_random_hf_model_saved_in_official_format(fmt, tmp_path):
    source = build_hf_model(seed=3)
    cfg = model_config(source.config)
    state_dict = official_state_dict(source)
    save_checkpoint(tmp_path / fmt, cfg, state_dict, fmt=fmt)
    hf_model = hf_from_official(tmp_path / "decoded", cfg, storage_roundtrip(state_dict, fmt))
    assert_reference_matches_hf(tmp_path / fmt, hf_model, cfg.vocab_size)


@pytest.mark.parametrize("checkpoint", ["tiny_ckpt", "tiny_ckpt_fp8"])
def test_make_tiny_checkpoint(checkpoint, request, tmp_path):
    path = request.getfixturevalue(checkpoint)
    cfg = ModelConfig.from_json(path)
    fmt = "fp8" if checkpoint.endswith("fp8") else "bf16"
    from dsv4.weights import load_state_dict

    decoded = load_state_dict(path, cfg, dtype=torch.float32)
    hf_model = hf_from_official(tmp_path, cfg, decoded) if fmt == "fp8" else (
        DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    )
    assert_reference_matches_hf(path, hf_model, cfg.vocab_size)
