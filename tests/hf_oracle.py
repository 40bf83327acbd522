"""Tiny random HF transformers DeepseekV4ForCausalLM models: the oracle for dsv4's reference model.

HF's initialisation leaves several parameters neutral (sinks, ape, hc base/scale, tid2eid, the
router bias all zero; norms all one; std 0.02 everywhere), which would hide bugs in exactly the
parts that are easiest to get wrong. `build_hf_model` re-randomises every parameter at a scale
where each one visibly moves the logits.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
import transformers.modeling_rope_utils as hf_rope_utils
import transformers.models.deepseek_v4.modeling_deepseek_v4 as hf_modeling
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from dsv4.config import ModelConfig
from dsv4.weights import hf_to_official

TINY_CONFIG = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "num_attention_heads": 4,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 32,
    "n_routed_experts": 6,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "swiglu_limit": 2.0,  # low enough that the clamps actually bite on random weights
    "sliding_window": 128,
    "index_n_heads": 16,
    "index_head_dim": 128,
    "index_topk": 16,  # fewer than the 75 compressed rows of a 300-token prompt
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "num_nextn_predict_layers": 0,
}


def tiny_hf_config(**overrides) -> DeepseekV4Config:
    return DeepseekV4Config(**{**TINY_CONFIG, **overrides})


def model_config(hf_config: DeepseekV4Config) -> ModelConfig:
    """The dsv4 view of an HF config (parsed from its HF-named dict, as a checkpoint would be)."""
    return ModelConfig.from_dict(hf_config.to_dict())


def build_hf_model(seed: int, hf_config: DeepseekV4Config | None = None) -> DeepseekV4ForCausalLM:
    """A float32 HF model with every parameter drawn from `seed` (see the module docstring)."""
    hf_config = hf_config or tiny_hf_config()
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(_random_like(name, tensor, hf_config, generator))
    return model


def _random_like(name: str, tensor: torch.Tensor, cfg: DeepseekV4Config, gen: torch.Generator) -> torch.Tensor:
    def normal(std: float = 1.0) -> torch.Tensor:
        return torch.randn(tensor.shape, generator=gen) * std

    def uniform(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(tensor.shape, generator=gen)

    if name.endswith("tid2eid"):
        # distinct experts per token, like a real table
        return torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)[: tensor.shape[1]]
                            for _ in range(tensor.shape[0])])
    if name.endswith("e_score_correction_bias"):
        return normal(0.3)
    if name.endswith("sinks"):
        return normal(1.0)
    if name.endswith("position_bias"):
        return normal(0.5)
    if name.endswith(("norm.weight", "layernorm.weight")):
        return uniform(0.5, 1.5)
    if name.endswith(("attn_hc.fn", "ffn_hc.fn", "hc_head.hc_fn")):
        return normal(1 / math.sqrt(tensor.shape[-1]))  # the mixes come out ~N(0, 1)
    if name.endswith(("attn_hc.base", "ffn_hc.base", "hc_head.hc_base")):
        return normal(0.5)
    if name.endswith(("attn_hc.scale", "ffn_hc.scale", "hc_head.hc_scale")):
        return uniform(0.5, 1.5)
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    # every remaining tensor is a projection [..., out, in]: unit-variance outputs for unit inputs
    return normal(1 / math.sqrt(tensor.shape[-1]))


def official_state_dict(model: DeepseekV4ForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under DeepSeek's official names (experts split per expert)."""
    return {name: t.clone() for name, t in hf_to_official(model.state_dict()).items()}


@torch.no_grad()
def hf_logits(model: DeepseekV4ForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-sequence logits, no cache."""
    return model(input_ids=input_ids, use_cache=False).logits


class _Float64Torch:
    """`torch`, except that float32 means float64 (see `hf_float64`)."""

    def __getattr__(self, name: str):
        return torch.float64 if name in ("float", "float32") else getattr(torch, name)


@contextlib.contextmanager
def _float32_means_float64():
    saved = hf_modeling.torch, hf_rope_utils.torch, torch.Tensor.float
    hf_modeling.torch = hf_rope_utils.torch = _Float64Torch()
    torch.Tensor.float = torch.Tensor.double
    try:
        yield
    finally:
        hf_modeling.torch, hf_rope_utils.torch, torch.Tensor.float = saved


def hf_float64_logits(model: DeepseekV4ForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """The same model's logits computed entirely in float64.

    HF's DeepSeek-V4 code hard-codes float32 for its norms, RoPE tables, softmaxes and mHC, so a
    plain `.double()` still rounds there. Inside this function every float32 request in HF's
    modeling and RoPE code means float64, and the RoPE tables are rebuilt under that rule, which
    makes the HF forward a true float64 computation.
    """
    with _float32_means_float64():
        double = DeepseekV4ForCausalLM(copy.deepcopy(model.config)).eval().double()
        double.set_experts_implementation("eager")  # the grouped-matmul experts path has no float64
        double.load_state_dict(model.state_dict())
        return hf_logits(double, input_ids)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max())
