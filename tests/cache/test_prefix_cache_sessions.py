"""64 concurrent sessions sharing a system prompt and tool list (bf16 index keys, a 20-page pool, so
that cached pages are evicted while they run), 30% aborted mid-stream: every completed output equals
the reference's (margin-aware), nothing stays referenced, and the cache served hits. (Colocated; the
host tier and PD are not part of this test.)"""

import asyncio
import random

import pytest

from dsv4.config import ServerArgs
from dsv4.engine.engine import Engine
from dsv4.engine.launch import load_model
from dsv4.protocol import GenerationRequest, SamplingParams
from dsv4.tiny import make_tiny
from tests.engine.test_engine_reference import NEW_TOKENS, assert_matches_reference

P = 128
SESSIONS = 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny"))


async def session(engine, rid, prompt, abort_after):
    """The session's tokens, or None when it was aborted after `abort_after` tokens."""
    request = GenerationRequest(rid=rid, input_ids=tuple(prompt),
                                sampling=SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    tokens = []
    async for out in engine.submit(request):
        tokens += out.token_ids
        if abort_after is not None and len(tokens) >= abort_after and not out.finished:
            engine.abort(rid, "test abort")
        if out.finished:
            return tokens if out.finish_reason == "length" else None
    raise AssertionError(f"{rid}: no finished output")


async def test_shared_system_prompt_sessions_with_aborts(checkpoint):
    args = ServerArgs(model=str(checkpoint), dtype="float32", index_key_dtype="bf16", chunked_prefill_size=256,
                      max_running_requests=16, max_total_tokens=P * 20)
    model = load_model(args)
    rng = random.Random(11)
    vocab = model.config.vocab_size
    system = [rng.randrange(vocab) for _ in range(2 * P + 30)]  # system prompt and tool list
    prompts = [system + [rng.randrange(vocab) for _ in range(rng.randint(5, 150))] for _ in range(SESSIONS)]
    aborts = [rng.randint(1, NEW_TOKENS - 1) if rng.random() < 0.3 else None for _ in range(SESSIONS)]
    engine = Engine(args, model.config, model.tokenizer, model.runner, model_name=model.name)
    await engine.start()
    try:
        async with asyncio.timeout(300):
            results = await asyncio.gather(*(session(engine, f"s{i}", p, a)
                                             for i, (p, a) in enumerate(zip(prompts, aborts, strict=True))))
        completed = [(p, r) for p, r, a in zip(prompts, results, aborts, strict=True) if a is None]
        assert all(r is not None for _, r in completed)
        assert_matches_reference(checkpoint, "index-bf16", [p for p, _ in completed], [r for _, r in completed])
        debug = engine.debug_requests()
        assert not debug["requests"]
        assert debug["free_pages"] == debug["total_pages"] and debug["free_slots"] == debug["total_slots"]
        assert debug["evictable_pages"] == debug["cached_pages"]
        registry = engine.metrics.registry
        assert registry.get_sample_value("dsv4_prefix_cache_hit_tokens_total", {"tier": "device"}) >= 2 * P * 32
        assert registry.get_sample_value("dsv4_prefix_cache_evicted_pages_total", {"tier": "device"}) > 0
    finally:
        await engine.stop()
