"""Small random DeepSeek-V4-architecture checkpoints (tests, benchmarks; the built-in model is dsv4/demo_model).

`make_tiny` writes a complete checkpoint directory: config.json, safetensors (official names,
bf16 or the official FP8/FP4 layout), tokenizer.json and tokenizer_config.json. Random weights
are scaled so activations stay O(1) through the layers, and every parameter the real model never
leaves neutral (norm weights, sinks, ape, hyper-connection fn/base/scale, gate bias, tid2eid) is
non-neutral, so a test cannot pass by accident of an identity. The values a test should compare
against are what the files decode to: `load_state_dict(dir)` or `tiny_state_dict(...)`.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from dsv4.config import CSA, HCA, WINDOW, ModelConfig, YarnScaling, expected_weights
from dsv4.weights import save_checkpoint, storage_roundtrip

RATIO = {WINDOW: 0, CSA: 4, HCA: 128}
VOCAB_MULTIPLE = 64
TOKENIZER_SIZE = 512  # specials + 256 bytes + learned merges; a multiple of 64 so no embedding row is unreachable
MODEL_MAX_LENGTH = 65536

# Layer schedules and sizes. Both keep the real head_dim 512 / rope 64 / index_head_dim 128 /
# window 128 because the engine's row formats (584 B main rows, 132 B indexer rows) depend on them.
PRESETS = {
    "tiny": {
        "layers": [WINDOW, CSA, HCA, CSA],
        "num_hash_layers": 1,
        "hidden_size": 64,
        "num_heads": 4,
        "o_groups": 2,
        "o_lora_rank": 32,
        "q_lora_rank": 64,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "index_n_heads": 16,
        "index_topk": 16,
    },
    "small": {
        "layers": [WINDOW, WINDOW, CSA, HCA, CSA, HCA, CSA, HCA],
        "num_hash_layers": 2,
        "hidden_size": 512,
        "num_heads": 16,
        "o_groups": 4,
        "o_lora_rank": 128,
        "q_lora_rank": 256,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "index_n_heads": 64,
        "index_topk": 512,
    },
}

# DeepSeek-V4 special tokens, in id order: BOS 0 and EOS 1 as in the real tokenizer.
SPECIAL_TOKENS = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
    "<｜latest_reminder｜>",
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜title｜>",
    "<｜read_url｜>",
    "<｜▁pad▁｜>",
]
# Kept in decoded text even when special tokens are skipped: the reasoning and tool-call parsers need them.
TEXT_TOKENS = {"<think>", "</think>", "｜DSML｜"}
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1], "<｜▁pad▁｜>"

# A little text for the BPE merges, so common words and chat/tool markup are single tokens.
_MERGE_TEXT = """
The quick brown fox jumps over the lazy dog. A model that is served should answer the question
that the user asked, and it should think before it answers. What is the weather in Paris today?
It is sunny and warm in Paris, with a light wind from the west. Please write a function that
returns the sum of two numbers. def add(a, b): return a + b. The function takes two arguments
and returns their sum. import json; print(json.dumps({"name": "get_weather", "arguments": {}}))
You are a helpful assistant. The user wants to know the time, the date and the location of the
meeting. Let me think about this step by step. First, we need the current date; then we can
compute the answer. The answer is 42. Thank you for your help! You're welcome. How can I help
you today? I would like to book a table for two people at seven o'clock in the evening.
<tool_result>{"temperature": 21, "unit": "celsius"}</tool_result> string="true" string="false"
<invoke name="search"> <parameter name="query"> </parameter> </invoke> tool_calls function
Hello, world! 你好，世界！今天天气很好。我们来写一个程序。谢谢你的帮助。日本語のテキストです。
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159 -1 +1 = == != <= >= () [] {} :: -> =>
"""


def tiny_config(preset: str = "tiny", vocab_size: int = TOKENIZER_SIZE) -> ModelConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    return ModelConfig(
        vocab_size=-(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
        hidden_size=p["hidden_size"],
        num_layers=len(p["layers"]),
        num_heads=p["num_heads"],
        head_dim=512,
        rope_head_dim=64,
        q_lora_rank=p["q_lora_rank"],
        o_groups=p["o_groups"],
        o_lora_rank=p["o_lora_rank"],
        n_routed_experts=p["n_routed_experts"],
        n_shared_experts=1,
        num_experts_per_tok=p["num_experts_per_tok"],
        moe_intermediate_size=p["moe_intermediate_size"],
        num_hash_layers=p["num_hash_layers"],
        sliding_window=128,
        index_n_heads=p["index_n_heads"],
        index_head_dim=128,
        index_topk=p["index_topk"],
        compress_ratios=tuple(RATIO[kind] for kind in p["layers"]),
        rope_scaling=YarnScaling(factor=16, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1),
    )


def random_state_dict(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Official name -> fp32 random tensor (tid2eid int64), before any storage rounding.

    Each tensor has its own generator seeded from (seed, name), so tensors do not depend on
    the order or number of the others.
    """
    return {name: _random_tensor(cfg, name, shape, seed) for name, shape in expected_weights(cfg).items()}


def _random_tensor(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen).mul_(std).add_(mean)

    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":  # distinct experts per token, as hash routing assigns them
        keys = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=gen)
        return keys.argsort(dim=-1)[:, : cfg.num_experts_per_tok].to(torch.int64)
    if name == "embed.weight":
        return normal(1.0)
    if name.endswith("norm.weight"):
        return normal(0.1, mean=1.0)
    if leaf in ("hc_attn_fn", "hc_ffn_fn", "hc_head_fn"):
        return normal(shape[-1] ** -0.5)  # mixes = fn @ (x / rms(x)): O(1) logits before scale/base
    if leaf in ("hc_attn_scale", "hc_ffn_scale", "hc_head_scale"):
        return 0.5 + torch.rand(shape, generator=gen)
    if leaf in ("hc_attn_base", "hc_ffn_base", "hc_head_base"):
        return normal(0.5)
    if leaf == "attn_sink":
        return normal(1.0)
    if leaf == "ape":
        return normal(0.5)
    if name.endswith("gate.bias"):
        return normal(0.3)
    return normal(shape[-1] ** -0.5)  # linear weights [out, in]: unit-variance outputs for unit-variance inputs


def tiny_state_dict(preset: str = "tiny", fmt: str = "bf16", seed: int = 0) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and fp32 tensors that `make_tiny(preset=, fmt=, seed=)` files decode to."""
    cfg = tiny_config(preset, build_tokenizer().get_vocab_size())
    return cfg, storage_roundtrip(random_state_dict(cfg, seed), fmt)


def make_tiny(out_dir: str | Path, preset: str = "tiny", fmt: str = "bf16", seed: int = 0) -> Path:
    """Write a complete random checkpoint directory; deterministic for a given (preset, fmt, seed)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    cfg = tiny_config(preset, tokenizer.get_vocab_size())
    save_checkpoint(out_dir, cfg, random_state_dict(cfg, seed), fmt=fmt)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    return out_dir


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
    }


def build_tokenizer(size: int = TOKENIZER_SIZE) -> HFTokenizer:
    """Byte-level BPE over the 256 byte symbols plus merges learned from a built-in text."""
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_MERGE_TEXT] * 4, trainer=trainer)
    # The trainer registers every special token as "special"; the parsing markers must survive
    # decoding with skip_special_tokens, so they become plain added tokens (still matched whole).
    spec = json.loads(tokenizer.to_str())
    for added in spec["added_tokens"]:
        added["special"] = added["content"] not in TEXT_TOKENS
    tokenizer = HFTokenizer.from_str(json.dumps(spec))
    if tokenizer.get_vocab_size() != size:
        raise RuntimeError(f"built-in merge text yields {tokenizer.get_vocab_size()} tokens, expected {size}")
    return tokenizer
