"""The served model's greedy output equals the reference's (ARCHITECTURE.md, testing oracles).

32 prompts of mixed lengths go through the engine (tiny checkpoint, real runner) all at once and
then one by one, with a prefill budget of 97 tokens so that chunks end mid-window and
mid-compression-group, and with fewer slots than prompts so that slots and pages are reused.

The reference is checked by teacher forcing: one full-sequence forward over prompt + the engine's
tokens gives, at every step, the reference's greedy choice given the same prefix and its top-2
margin. Where every earlier token agrees this is exactly `ReferenceModel.greedy_generate`, at an
eighth of the cost; a disagreement passes only where that margin is below EPS (a genuine tie).
"""

import asyncio
import random

import pytest
import torch

from dsv4.config import ServerArgs
from dsv4.engine.engine import Engine
from dsv4.engine.launch import load_model
from dsv4.protocol import GenerationRequest, SamplingParams
from dsv4.reference.model import load_reference_model
from dsv4.tiny import make_tiny

NEW_TOKENS = 8
EPS = 1e-5
# Window and page edges (128), compression groups (4) and a long prompt; the rest short and random.
EDGE_LENGTHS = [1, 2, 3, 4, 5, 96, 97, 98, 127, 128, 129, 194, 255, 256, 257, 600]
VARIANTS = {  # name: (index_key_dtype, kv_cache_dtype, prompts used)
    "fp32": ("fp32", "auto", 32),
    "index-bf16": ("bf16", "auto", 3),
    "index-fp8": ("fp8", "auto", 3),
    "kv-fp8": ("fp8", "fp8_e4m3", 3),
}
ROUNDING_PROMPT_LENGTHS = (5, 130, 333)

_reference_models = {}
_reference_steps = {}  # (variant, prompt, tokens) -> [(greedy token, top-2 margin)] per step


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny"))


def make_prompts(lengths, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def prompt_lengths():
    rng = random.Random(1)
    lengths = EDGE_LENGTHS + [rng.randint(1, 64) for _ in range(32 - len(EDGE_LENGTHS))]
    rng.shuffle(lengths)  # long and short prompts interleave in arrival order
    return lengths


def reference_steps(checkpoint, variant, prompt, tokens):
    key = (variant, tuple(prompt), tuple(tokens))
    if key not in _reference_steps:
        if variant not in _reference_models:
            index_key_dtype, kv_cache_dtype, _ = VARIANTS[variant]
            _reference_models[variant] = load_reference_model(
                checkpoint, dtype=torch.float32, index_key_dtype=index_key_dtype, kv_cache_dtype=kv_cache_dtype
            )
        logits = _reference_models[variant](torch.tensor([prompt + tokens[:-1]]))[0, len(prompt) - 1 :]
        top = logits.topk(2)
        _reference_steps[key] = list(zip(top.indices[:, 0].tolist(), (top.values[:, 0] - top.values[:, 1]).tolist()))
    return _reference_steps[key]


async def generate(engine, rid, prompt):
    request = GenerationRequest(rid=rid, input_ids=tuple(prompt),
                                sampling=SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    outputs = [out async for out in engine.submit(request)]
    assert outputs[-1].finish_reason == "length", outputs[-1]
    return [t for out in outputs for t in out.token_ids]


def assert_matches_reference(checkpoint, variant, prompts, results):
    for i, (prompt, tokens) in enumerate(zip(prompts, results)):
        assert len(tokens) == NEW_TOKENS
        for step, (token, (expected, margin)) in enumerate(zip(tokens, reference_steps(checkpoint, variant, prompt, tokens))):
            assert token == expected or margin < EPS, (
                f"{variant}: prompt {i} ({len(prompt)} tokens) step {step}: engine {token}, reference {expected} "
                f"(top-2 margin {margin:.3g})"
            )


@pytest.mark.parametrize("variant", list(VARIANTS))
async def test_engine_greedy_equals_reference(checkpoint, variant):
    index_key_dtype, kv_cache_dtype, count = VARIANTS[variant]
    args = ServerArgs(model=str(checkpoint), dtype="float32", index_key_dtype=index_key_dtype,
                      kv_cache_dtype=kv_cache_dtype, chunked_prefill_size=97, max_running_requests=8,
                      max_total_tokens=128 * 48)
    model = load_model(args)
    lengths = prompt_lengths() if count == 32 else ROUNDING_PROMPT_LENGTHS
    prompts = make_prompts(lengths, model.config.vocab_size)
    engine = Engine(args, model.config, model.tokenizer, model.runner, model_name=model.name)
    await engine.start()
    try:
        async with asyncio.timeout(300):
            together = await asyncio.gather(*(generate(engine, f"all-{i}", p) for i, p in enumerate(prompts)))
            assert_matches_reference(checkpoint, variant, prompts, together)
            if count == 32:
                alone = [await generate(engine, f"one-{i}", p) for i, p in enumerate(prompts)]
                assert_matches_reference(checkpoint, variant, prompts, alone)
        debug = engine.debug_requests()
        assert debug["free_pages"] == debug["total_pages"] and debug["free_slots"] == debug["total_slots"]
    finally:
        await engine.stop()
