"""Greedy outputs served from prefix-cache hits equal the reference's (margin-aware, as in
tests/engine/test_engine_reference.py), for fp8 and bf16 index keys and fp8 main rows: full hits,
partial hits at every page boundary of a 3-page prompt, a shared prefix that ends inside the CSA
window right after a page boundary (the snapshot must carry the overlap half) and one that ends just
before it (no hit), and a second turn that extends the first turn's prompt and output (including a
page completed by decoding). The indexer's selections on hit paths agree with the reference
(`--verify-indexer`), and nothing stays referenced afterwards."""

import asyncio
import random

import pytest

from dsv4.config import ServerArgs
from dsv4.engine.engine import Engine
from dsv4.engine.launch import load_model
from dsv4.protocol import GenerationRequest, SamplingParams
from dsv4.tiny import make_tiny
from tests.engine.test_engine_reference import NEW_TOKENS, VARIANTS, assert_matches_reference

P = 128


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny"))


async def generate(engine, rid, prompt):
    request = GenerationRequest(rid=rid, input_ids=tuple(prompt),
                                sampling=SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    outputs = [out async for out in engine.submit(request)]
    assert outputs[-1].finish_reason == "length", outputs[-1]
    return [t for out in outputs for t in out.token_ids], outputs[-1].cached_tokens


def indexer_mismatches(engine) -> tuple[float, float]:
    registry = engine.metrics.registry
    verified = registry.get_sample_value("dsv4_indexer_verified_total")
    mismatches = sum(s.value for m in registry.collect() if m.name == "dsv4_indexer_mismatch"
                     for s in m.samples if s.name.endswith("_total"))
    return verified, mismatches


@pytest.mark.parametrize("variant", ["index-fp8", "index-bf16", "kv-fp8"])
async def test_greedy_outputs_with_cache_hits_equal_the_reference(checkpoint, variant):
    index_key_dtype, kv_cache_dtype, _ = VARIANTS[variant]
    args = ServerArgs(model=str(checkpoint), dtype="float32", index_key_dtype=index_key_dtype,
                      kv_cache_dtype=kv_cache_dtype, chunked_prefill_size=97, max_running_requests=8,
                      max_total_tokens=P * 48, verify_indexer="count")
    model = load_model(args)
    rng = random.Random(7)

    def fresh(n):
        return [rng.randrange(model.config.vocab_size) for _ in range(n)]

    base = fresh(3 * P + 40)  # three whole pages and part of a fourth
    hits = {  # prompt -> tokens it must find cached
        "full": (base, 3 * P),
        **{f"boundary-{k}": (base[: k * P] + fresh(50), k * P) for k in (1, 2, 3)},
        "in-csa-window-after-boundary": (base[: P + 2] + fresh(30), P),
        "in-csa-window-before-boundary": (base[: P - 2] + fresh(30), 0),
    }
    engine = Engine(args, model.config, model.tokenizer, model.runner, model_name=model.name)
    await engine.start()
    try:
        async with asyncio.timeout(300):
            first = [await generate(engine, "cold", base)]
            assert first[0][1] == 0
            served = await asyncio.gather(*(generate(engine, name, p) for name, (p, _) in hits.items()))
            for (name, (_, cached)), (_, got) in zip(hits.items(), served, strict=True):
                assert got == cached, f"{name}: {got} cached tokens, expected {cached}"
            # Multi-turn: the first turn decodes across a page boundary (its page 0 is cached by a decode).
            turn1 = fresh(P - 3)
            (turn1_out, _), = [await generate(engine, "turn1", turn1)]
            turn2 = turn1 + turn1_out + fresh(60)
            turn2_out, turn2_cached = await generate(engine, "turn2", turn2)
            assert turn2_cached == P
            prompts = [base, *(p for p, _ in hits.values()), turn1, turn2]
            results = [first[0][0], *(tokens for tokens, _ in served), turn1_out, turn2_out]
            assert_matches_reference(checkpoint, variant, prompts, results)
        verified, mismatches = indexer_mismatches(engine)
        assert verified > 0 and mismatches == 0
        debug = engine.debug_requests()
        assert debug["cached_pages"] > 0 and debug["evictable_pages"] == debug["cached_pages"]
        assert debug["free_pages"] == debug["total_pages"] and debug["free_slots"] == debug["total_slots"]
        hit_tokens = engine.metrics.registry.get_sample_value("dsv4_prefix_cache_hit_tokens_total",
                                                              {"tier": "device"})
        assert hit_tokens == sum(cached for _, cached in hits.values()) + P
    finally:
        await engine.stop()
