"""`python -m dsv4 make-tiny` and the tiny presets it writes."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4.__main__ import main
from dsv4.config import CSA, HCA, WINDOW, ModelConfig, expected_weights
from dsv4.tiny import make_tiny, tiny_config, tiny_state_dict
from dsv4.tokenizer import Tokenizer


def test_make_tiny_in_a_subprocess(tmp_path):
    out = tmp_path / "ckpt"
    result = subprocess.run(
        [sys.executable, "-m", "dsv4", "make-tiny", "--out", str(out), "--format", "fp8", "--seed", "3"],
        capture_output=True, text=True, timeout=180, check=False, cwd=Path(__file__).parents[2],
    )
    assert result.returncode == 0, result.stderr
    assert str(out) in result.stdout
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    cfg = ModelConfig.from_json(out)
    assert cfg == tiny_config("tiny", Tokenizer.from_dir(out).vocab_size)
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] > 0


def test_bad_arguments_exit_with_usage(capsys):
    with pytest.raises(SystemExit) as info:
        main(["make-tiny", "--out", "x", "--preset", "huge"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_make_tiny_is_deterministic_per_seed(tiny_ckpt, tmp_path):
    again = make_tiny(tmp_path / "again", seed=0)
    other = make_tiny(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_ckpt / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (tiny_ckpt / "model.safetensors").read_bytes()


def test_tiny_preset_covers_every_layer_type():
    cfg = tiny_config()
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
    assert {WINDOW, CSA, HCA} <= set(kinds)
    assert 0 < cfg.num_hash_layers < cfg.num_layers  # hash-routed and score-routed MoE layers
    assert (cfg.head_dim, cfg.rope_head_dim, cfg.index_head_dim, cfg.sliding_window) == (512, 64, 128, 128)
    assert cfg.index_n_heads >= 16 and cfg.index_topk < 200 // 4
    assert cfg.vocab_size % 64 == 0
    assert sum(math.prod(shape) for shape in expected_weights(cfg).values()) < 5_000_000


def test_small_preset_has_tens_of_millions_of_parameters():
    cfg = tiny_config("small")
    assert 10e6 < sum(math.prod(shape) for shape in expected_weights(cfg).values()) < 100e6


def test_tiny_parameters_are_not_neutral():
    """Norm weights, sinks, ape, hyper-connection fn/base/scale and gate biases: none left at 0 or 1."""
    cfg, weights = tiny_state_dict()
    leaves = ("norm.weight", "attn_sink", "ape", "_fn", "_base", "_scale", "gate.bias")
    checked = [name for name in weights if name.endswith(leaves)]
    assert len(checked) > 10 * cfg.num_layers
    for name in checked:
        tensor = weights[name]
        assert not torch.all(tensor == 1) and not torch.all(tensor == 0), name
        assert tensor.numel() == 1 or tensor.amin() < tensor.amax(), name
    for i in range(cfg.num_hash_layers):
        tid2eid = weights[f"layers.{i}.ffn.gate.tid2eid"]
        assert tid2eid.min() >= 0 and tid2eid.max() < cfg.n_routed_experts
        assert (tid2eid.sort(dim=1).values.diff(dim=1) != 0).all()  # distinct experts per token
        assert tid2eid.unique(dim=0).shape[0] > 1
