"""dsv4.reference against HF transformers' DeepseekV4ForCausalLM on random tiny checkpoints.

The tiny config (tests/hf_oracle.py) has a window layer, two CSA layers and an HCA layer, hash
and learned routing, head_dim 512 with 64 RoPE dims, 16 indexer heads with top-16 selection, a
128-token window and YaRN on the compressed layers, so prompts of 127..300 tokens cross the
window edge, the first HCA row and the point where the indexer starts to choose.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.config import expected_weights
from dsv4.reference import ReferenceModel, load_reference_model
from dsv4.weights import save_checkpoint, storage_roundtrip
from tests.hf_oracle import (
    build_hf_model,
    hf_float64_logits,
    hf_logits,
    model_config,
    official_state_dict,
    relative_error,
    tiny_hf_config,
)

SEEDS = (0, 1)
PROMPT_LENGTHS = (1, 3, 4, 5, 127, 128, 129, 300)
FP32_TOLERANCE = 1e-4
FP64_TOLERANCE = 1e-10
CSA_LAYER, HCA_LAYER = 1, 2


class Oracle:
    def __init__(self, seed: int):
        self.seed = seed
        self.hf = build_hf_model(seed, tiny_hf_config())
        self.cfg = model_config(self.hf.config)
        self.state_dict = official_state_dict(self.hf)
        self.reference = ReferenceModel(self.cfg, self.state_dict)

    def prompt(self, length: int, batch: int = 1) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1000 * self.seed + length)
        return torch.randint(0, self.cfg.vocab_size, (batch, length), generator=generator)


@pytest.fixture(scope="module", params=SEEDS, ids=lambda seed: f"seed{seed}")
def oracle(request) -> Oracle:
    return Oracle(request.param)


@pytest.fixture(scope="module")
def oracle0() -> Oracle:
    return Oracle(0)


def rms_relative_change(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt())


def test_tiny_config_exercises_every_layer_kind(oracle0):
    cfg = oracle0.cfg
    assert cfg.compress_ratios == (0, 4, 128, 4)
    assert cfg.num_hash_layers == 2
    assert (cfg.head_dim, cfg.rope_head_dim, cfg.index_head_dim, cfg.sliding_window) == (512, 64, 128, 128)
    assert cfg.index_n_heads >= 16 and cfg.index_topk < max(PROMPT_LENGTHS) // 4
    assert cfg.rope_scaling is not None


def test_hf_weights_have_exactly_the_expected_official_names_and_shapes(oracle0):
    shapes = {name: tuple(t.shape) for name, t in oracle0.state_dict.items()}
    assert shapes == expected_weights(oracle0.cfg)


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_logits_match_hf(oracle, length):
    input_ids = oracle.prompt(length)
    expected = hf_logits(oracle.hf, input_ids)
    actual = oracle.reference(input_ids)
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    assert relative_error(actual, expected) < FP32_TOLERANCE


def test_batched_prompts_match_hf(oracle0):
    input_ids = oracle0.prompt(129, batch=2)
    actual = oracle0.reference(input_ids)
    assert relative_error(actual, hf_logits(oracle0.hf, input_ids)) < FP32_TOLERANCE
    # rows of a batch are independent (up to matmul blocking, which may differ with the batch size)
    assert relative_error(actual[1:], oracle0.reference(input_ids[1:])) < 1e-6


def test_float64_is_the_same_math_as_hf(oracle0):
    input_ids = oracle0.prompt(300)
    reference = ReferenceModel(oracle0.cfg, oracle0.state_dict, dtype=torch.float64)
    actual = reference(input_ids)
    assert actual.dtype == torch.float64
    assert relative_error(actual, hf_float64_logits(oracle0.hf, input_ids)) < FP64_TOLERANCE


def test_compressor_rows_match_hf(oracle0):
    """The pooled, normed, RoPE'd rows of each compressor kind, against HF's own modules."""
    cfg = oracle0.cfg
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(2, 300, cfg.hidden_size, generator=generator)
    q_residual = torch.randn(2, 300, cfg.q_lora_rank, generator=generator)
    positions = torch.arange(300)
    for layer in (CSA_LAYER, HCA_LAYER):
        hf_compressor = oracle0.hf.model.layers[layer].self_attn.compressor
        with torch.no_grad():
            hf_rows, _ = hf_compressor(x, q_residual, positions.expand(2, -1), None, layer)
        rows = oracle0.reference.blocks[layer].attn.compressor(x)
        assert rows.shape == (2, 300 // cfg.compress_ratios[layer], cfg.head_dim)
        assert relative_error(rows, hf_rows.squeeze(1)) < 1e-5


@pytest.mark.parametrize("length", [9, 300])
def test_indexer_picks_match_hf(oracle0, length):
    """Same picks in the same order, including the -1 of queries that see fewer than top-k rows."""
    cfg = oracle0.cfg
    generator = torch.Generator().manual_seed(length)
    x = torch.randn(1, length, cfg.hidden_size, generator=generator)
    q_residual = torch.randn(1, length, cfg.q_lora_rank, generator=generator)
    positions = torch.arange(length)
    hf_indexer = oracle0.hf.model.layers[CSA_LAYER].self_attn.compressor.indexer
    with torch.no_grad():
        expected = hf_indexer(x, q_residual, positions.unsqueeze(0), None, CSA_LAYER)
    picks = oracle0.reference.blocks[CSA_LAYER].attn.indexer(x, q_residual, positions)
    assert torch.equal(picks, expected)
    assert (picks[0, :3] == -1).all() and (picks[0, 3, 1:] == -1).all() and picks[0, 3, 0] == 0


def test_greedy_generate_matches_hf_greedy(oracle0):
    """Crosses the first HCA row and the window edge while generating (positions 125..128)."""
    prompt = oracle0.prompt(125)[0].tolist()
    tokens, margins = oracle0.reference.greedy_generate(prompt, 4)
    # HF is causal: one forward over the whole generated sequence gives every step's logits
    steps = hf_logits(oracle0.hf, torch.tensor([prompt + tokens]))[0, len(prompt) - 1 : -1]
    top2 = steps.topk(2, dim=-1)
    assert tokens == top2.indices[:, 0].tolist()
    assert margins == pytest.approx((top2.values[:, 0] - top2.values[:, 1]).tolist(), abs=1e-4)


def test_greedy_generate_stops_at_a_stop_token(oracle0):
    prompt = oracle0.prompt(6)[0].tolist()
    tokens, _ = oracle0.reference.greedy_generate(prompt, 4)
    stopped, margins = oracle0.reference.greedy_generate(prompt, 4, stop_token_ids=(tokens[1],))
    assert stopped == tokens[: tokens.index(tokens[1]) + 1] and len(margins) == len(stopped)


def test_full_precision_row_formats_change_nothing(oracle0):
    input_ids = oracle0.prompt(300)
    expected = oracle0.reference(input_ids)
    for options in ({"index_key_dtype": "fp32"}, {"kv_cache_dtype": "auto"}):
        assert torch.equal(ReferenceModel(oracle0.cfg, oracle0.state_dict, **options)(input_ids), expected)


@pytest.mark.parametrize(
    "options, max_change",
    [
        ({"index_key_dtype": "bf16"}, 0.02),
        ({"index_key_dtype": "fp8"}, 0.1),
        ({"kv_cache_dtype": "fp8_e4m3"}, 0.2),
    ],
)
def test_cached_row_formats_change_logits_slightly(oracle0, options, max_change):
    """Rounding cached rows moves logits (the indexer may swap a few near-tied rows) but only a little.

    Limits are on the RMS change over all 300 positions; fp8 KV rows carry ~2.5% error each, which a
    random 4-layer model amplifies to ~7%.
    """
    input_ids = oracle0.prompt(300)
    expected = oracle0.reference(input_ids)
    actual = ReferenceModel(oracle0.cfg, oracle0.state_dict, **options)(input_ids)
    assert 1e-5 < rms_relative_change(actual, expected) < max_change
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


def test_rejects_a_state_dict_that_does_not_fit_the_config(oracle0):
    state_dict = dict(oracle0.state_dict)
    del state_dict["layers.1.attn.indexer.compressor.ape"]
    with pytest.raises(ValueError, match="layers.1.attn.indexer.compressor.ape"):
        ReferenceModel(oracle0.cfg, state_dict)
    state_dict = {**oracle0.state_dict, "layers.9.attn.wkv.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="layers.9.attn.wkv.weight"):
        ReferenceModel(oracle0.cfg, state_dict)
    state_dict = {**oracle0.state_dict, "mtp.0.attn.wkv.weight": torch.zeros(1)}  # MTP is ignored
    ReferenceModel(oracle0.cfg, state_dict)


def test_load_reference_model_reads_a_checkpoint(oracle0, tmp_path):
    save_checkpoint(tmp_path, oracle0.cfg, oracle0.state_dict, fmt="bf16")
    input_ids = oracle0.prompt(20)
    expected = ReferenceModel(oracle0.cfg, storage_roundtrip(oracle0.state_dict, "bf16"))(input_ids)
    assert torch.equal(load_reference_model(tmp_path)(input_ids), expected)


def test_bfloat16_compute_stays_close(oracle0):
    input_ids = oracle0.prompt(64)
    expected = oracle0.reference(input_ids)
    actual = ReferenceModel(oracle0.cfg, oracle0.state_dict, dtype=torch.bfloat16)(input_ids)
    assert actual.dtype == torch.float32
    assert rms_relative_change(actual, expected) < 0.1
