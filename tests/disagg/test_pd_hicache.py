"""PD with the host tier on the prefill side: 64 concurrent sessions sharing a system prompt and tool
list (bf16 index keys) in two waves, a prefill device pool of 8 pages and a prompt that fills it
between the waves, so that the shared pages go to the host tier and come back; 30% aborted
mid-stream on the decode side, copies delayed and reordered. Every
completed output equals the reference's greedy output for that session alone (margin-aware), the
prefill's hits shortened its prefills (host-tier hits included), and afterwards neither side holds
a request, transfer, page or slot, and every host unit is free or held by one live cache node."""

from __future__ import annotations

import asyncio
import random

import pytest
from pd_helpers import held, wait_until

from dsv4.protocol import GenerationRequest, SamplingParams
from tests.cache.test_hicache_reference import assert_accounted, metric
from tests.engine.test_engine_reference import NEW_TOKENS, assert_matches_reference

P = 128
SESSIONS = 64


async def session(decode, rid, prompt, abort_after):
    """The session's tokens, or None when it was aborted after `abort_after` tokens."""
    request = GenerationRequest(rid=rid, input_ids=tuple(prompt),
                                sampling=SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    tokens = []
    async with asyncio.timeout(120):
        async for out in decode.submit(request):
            tokens += out.token_ids
            if abort_after is not None and len(tokens) >= abort_after and not out.finished:
                decode.abort(rid, "test abort")
            if out.finished:
                return tokens if out.finish_reason == "length" else None
    raise AssertionError(f"{rid}: no finished output")


@pytest.mark.timeout(240)
async def test_shared_prefix_sessions_under_pd_with_the_host_tier(make_pd, tiny_ckpt):
    exact = {"dtype": "float32", "index_key_dtype": "bf16", "max_running_requests": 16, "chunked_prefill_size": 256}
    prefill, decode = await make_pd(
        prefill_args={**exact, "verify_indexer": "count", "context_length": None, "max_total_tokens": 8 * P,
                      "enable_hierarchical_cache": True, "hicache_ratio": 4.0, "verify_transfers": True,
                      "fault_inject": "delay:hicache_load:0.3:20ms,delay:hicache_write:0.3:20ms"},
        decode_args={**exact, "max_total_tokens": 48 * P})
    rng = random.Random(11)
    vocab = prefill.engine.model_config.vocab_size
    system = [rng.randrange(2, vocab) for _ in range(2 * P + 30)]  # system prompt and tool list
    prompts = [system + [rng.randrange(2, vocab) for _ in range(rng.randint(5, 150))] for _ in range(SESSIONS)]
    aborts = [rng.randint(1, NEW_TOKENS - 1) if rng.random() < 0.3 else None for _ in range(SESSIONS)]
    # Two waves of 32 concurrent sessions, and between them one prompt as large as the prefill's device
    # pool: the shared pages leave its device for the host tier, and the second wave's hits load them.
    pusher = [rng.randrange(2, vocab) for _ in range(8 * P - 20)]
    prompts.insert(SESSIONS // 2, pusher)
    aborts.insert(SESSIONS // 2, None)
    runs = [session(decode, f"s{i}", p, a) for i, (p, a) in enumerate(zip(prompts, aborts, strict=True))]
    results = [*await asyncio.gather(*runs[: SESSIONS // 2]), await runs[SESSIONS // 2],
               *await asyncio.gather(*runs[SESSIONS // 2 + 1 :])]
    completed = [(p, r) for p, r, a in zip(prompts, results, aborts, strict=True) if a is None]
    assert completed and all(r is not None for _, r in completed)
    assert_matches_reference(tiny_ckpt, "index-bf16", [p for p, _ in completed], [r for _, r in completed])

    engine = prefill.engine
    assert metric(engine, "dsv4_prefix_cache_hit_tokens_total", {"tier": "host"}) > 0
    assert metric(engine, "dsv4_prefix_cache_hit_tokens_total", {"tier": "device"}) > 0
    assert metric(engine, "dsv4_prefix_cache_evicted_pages_total", {"tier": "device"}) > 0
    assert metric(engine, "dsv4_hicache_load_failures_total") == 0
    assert sum(s.value for m in engine.metrics.registry.collect() if m.name == "dsv4_indexer_mismatch"
               for s in m.samples if s.name.endswith("_total")) == 0
    await wait_until(lambda: not any(held(decode).values()) and not any(held(prefill).values()), 15,
                     "both sides to release everything", explain=lambda: (held(decode), held(prefill)))
    # The last requests' write-through copies may still be in flight (writes are delayed here), and an
    # idle single-rank engine applies finished copies only at its next tick: apply them, then account.
    cache = engine.scheduler.cache
    await wait_until(lambda: all(node.copy.fence.done() for node in cache._in_flight), 15, "host writes to finish")
    cache.poll()
    assert_accounted(engine)
    # The decode side hears the prefill's readiness by heartbeat: ready again within a few of them.
    await wait_until(lambda: decode.ready()[0] and prefill.ready()[0], 20, "both sides to be ready",
                     explain=lambda: (decode.ready(), prefill.ready()))
