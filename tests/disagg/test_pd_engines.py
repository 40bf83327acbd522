"""A PD pair of real engines (tiny checkpoint) in this process, over UCX on 127.0.0.1: per-request
failures on the prefill side end that request with its reason and status, and the pair stays ready
and serves what follows (ARCHITECTURE.md invariant 5)."""

from __future__ import annotations

import asyncio
import random
import re
import time

import pytest
from pd_helpers import CHUNK, PREFILL_CONTEXT, engine_of, held, wait_until

from dsv4.engine import grammar
from dsv4.engine.request import AdmissionError
from dsv4.protocol import GenerationRequest, SamplingParams

VICTIM_LAYER, VICTIM_ROW = 1, 5  # tiny: layer 1 is CSA


def request(rid: str, length: int, **sampling) -> GenerationRequest:
    rng = random.Random(rid)
    return GenerationRequest(rid=rid, input_ids=tuple(rng.randrange(2, 500) for _ in range(length)),
                             sampling=SamplingParams(**{"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True,
                                                        **sampling}))


async def outputs_of(stream, timeout: float = 20.0):
    async with asyncio.timeout(timeout):
        return [o async for o in stream]


async def assert_still_serving(prefill, decode, tag: str):
    assert decode.ready() == (True, []), decode.ready()
    assert prefill.ready() == (True, []), prefill.ready()
    started = time.monotonic()
    results = await asyncio.gather(*(outputs_of(decode.submit(request(f"{tag}-after-{i}", 10 + 9 * i)))
                                     for i in range(8)))
    for outs in results:
        assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 3, outs[-1]
    assert time.monotonic() - started < 30
    assert decode.ready()[0] and prefill.ready()[0]


async def test_a_killed_prefill_transfer_task_fails_that_request_only(make_pd):
    prefill, decode = await make_pd("kill:transfer_task")
    outs = await outputs_of(decode.submit(request("killed", 40)))
    assert outs[-1].finish_reason == "error" and outs[-1].error_status == 500
    assert "kill:transfer_task" in outs[-1].error
    await assert_still_serving(prefill, decode, "killed")


async def test_a_prompt_beyond_the_prefill_context_is_refused_before_any_transfer(make_pd):
    prefill, decode = await make_pd()
    too_long = request("too-long", PREFILL_CONTEXT + 20)
    decode.engine.check_request(too_long)  # the decode engine alone would take it
    with pytest.raises(AdmissionError, match=f"context limit of {PREFILL_CONTEXT} tokens"):
        decode.submit(too_long)
    assert not decode.side.transfers
    # Past the decode's check (limits are a hint), the prefill engine refuses it: a 400 as well.
    outs = await outputs_of(decode.side.submit(too_long))
    assert outs[-1].finish_reason == "error" and outs[-1].error_status == 400
    assert "context limit" in outs[-1].error
    await assert_still_serving(prefill, decode, "too-long")


async def test_a_verify_indexer_failure_on_the_prefill_fails_that_request_only(make_pd):
    prefill, decode = await make_pd()
    runner = prefill.engine.runner
    forward, corrupted = runner.forward, []

    def corrupt_before_the_second_chunk(batch):
        chunk = next((c for c in batch.chunks if c.start_pos == CHUNK), None)
        if chunk is not None and not corrupted:
            runner.pools.index_keys(VICTIM_LAYER)[chunk.page_ids[0], VICTIM_ROW, :3] ^= 0x08
            corrupted.append(chunk.rid)
        return forward(batch)

    runner.forward = corrupt_before_the_second_chunk
    try:
        outs = await outputs_of(decode.submit(request("victim", CHUNK + 60)))
    finally:
        runner.forward = forward
    assert corrupted
    assert outs[-1].finish_reason == "error" and outs[-1].error_status >= 500
    assert "indexer cross-check failed" in outs[-1].error
    await assert_still_serving(prefill, decode, "victim")


async def test_a_request_deadline_during_prefill_fails_that_request_only(make_pd):
    prefill, decode = await make_pd()
    late = GenerationRequest(rid="late", input_ids=request("late", 200).input_ids,
                             sampling=request("late", 1).sampling, deadline=time.monotonic() + 0.02)
    outs = await outputs_of(decode.submit(late))
    assert outs[-1].finish_reason == "error" and "deadline" in outs[-1].error
    await wait_until(lambda: not decode.side.transfers, 10, "the transfer's lease to end")
    await assert_still_serving(prefill, decode, "late")


async def test_an_unencodable_seed_fails_that_request_only(make_pd):
    prefill, decode = await make_pd()
    outs = await outputs_of(decode.submit(request("seed", 30, temperature=1.0, seed=1 << 70)))
    assert outs[-1].finish_reason == "error" and outs[-1].error_status == 400
    await assert_still_serving(prefill, decode, "seed")


async def test_seeded_sampling_in_pd_equals_colocated(make_pd, tiny_ckpt):
    """The prefill samples the first token, the decode side the rest: with sampling a function of
    (seed, position), a seeded request continues exactly as it would on one engine."""
    _prefill, decode = await make_pd()
    colocated, _ = engine_of(tiny_ckpt)
    await colocated.start()
    try:
        reqs = [request(f"seeded-{i}", 30 + 40 * i, temperature=0.9, top_k=50, seed=1234 + i, max_new_tokens=8)
                for i in range(4)]
        pd = await asyncio.gather(*(outputs_of(decode.submit(r)) for r in reqs))
        alone = await asyncio.gather(*(outputs_of(colocated.submit(r)) for r in reqs))
    finally:
        await colocated.stop()
    for got, want in zip(pd, alone):
        tokens = [t for o in got for t in o.token_ids]
        assert got[-1].finish_reason == "length" and len(tokens) == 8
        assert tokens == [t for o in want for t in o.token_ids]


@pytest.mark.timeout(720)
async def test_memory_pressure_on_the_decode_side_serves_every_request_unchanged(make_pd, tiny_ckpt):
    """16 requests of 100 prompt + 400 new tokens (ignore_eos) on a decode pool of 2,048 tokens: 16
    pages of 128, four such requests at their full length. Transfers take their destination under
    the scheduler's admission rule, decodes are retracted (an adopted one recomputes its prompt
    here), and every request ends as it does on one engine without pressure (ARCHITECTURE.md
    invariant 5: memory pressure never fails a request)."""
    exact = {"dtype": "float32", "index_key_dtype": "fp32", "max_running_requests": 16}
    prefill, decode = await make_pd(prefill_args={**exact, "verify_indexer": "off"},
                                    decode_args={**exact, "max_total_tokens": 2048})
    colocated, _ = engine_of(tiny_ckpt, **exact, max_total_tokens=64 * 128)  # room for all sixteen
    await colocated.start()
    reqs = [request(f"pressure-{i}", 100, max_new_tokens=400) for i in range(16)]
    started = time.monotonic()
    try:  # both at once: the forwards run on two threads
        pd, alone = await asyncio.gather(
            # 6,400 tokens each side with retractions: 93-214 s on 2 busy cores, 240 s was once too short
            asyncio.gather(*(outputs_of(decode.submit(r), timeout=600) for r in reqs)),
            asyncio.gather(*(outputs_of(colocated.submit(r), timeout=600) for r in reqs)))
    finally:
        await colocated.stop()
    seconds = time.monotonic() - started
    for r, got, want in zip(reqs, pd, alone):
        assert got[-1].finish_reason == "length", got[-1]
        assert [t for o in got for t in o.token_ids] == [t for o in want for t in o.token_ids], r.rid
    preemptions = decode.engine.metrics.registry.get_sample_value("dsv4_preemptions_total")
    assert preemptions > 0, "the pool was meant to be too small for every request at once"
    await wait_until(lambda: not any(held(decode).values()) and not any(held(prefill).values()), 10,
                     "both sides to release everything", explain=lambda: (held(decode), held(prefill)))
    assert decode.ready() == (True, []) and prefill.ready() == (True, [])
    print(f"PD under pressure: {seconds:.1f} s, {preemptions:.0f} preemptions")


async def test_a_grammar_holds_across_the_transfer(make_pd):
    """The prefill side samples the first token under the request's grammar (it travels in
    SamplingParams); the decode side's matcher starts past that token."""
    _, decode = await make_pd()
    pattern = "(alpha|beta) [0-9]{3}"
    for seed in range(4):
        req = request(f"pd-grammar-{seed}", 40, max_new_tokens=24, temperature=0.9, seed=seed, ignore_eos=False,
                      grammar=grammar.from_regex(pattern))
        outputs = await outputs_of(decode.submit(req))
        assert outputs[-1].finish_reason == "stop", outputs[-1]
        assert re.fullmatch(pattern, "".join(o.text for o in outputs)), outputs


async def test_logprobs_cross_from_prefill_to_decode_as_colocated(make_pd, tiny_ckpt):
    """The first token's logprobs (sampled on the prefill side) and the prompt's (computed across
    its prefill chunks) travel in the Commit: the decode side returns what one colocated engine does."""
    _, decode = await make_pd()
    colocated, _ = engine_of(tiny_ckpt)
    await colocated.start()
    try:
        asks = {"logprobs": 3, "prompt_logprobs": 2, "prompt_logprobs_start": 5, "temperature": 0.8, "seed": 4,
                "max_new_tokens": 5}
        pd = await outputs_of(decode.submit(request("lp", CHUNK + 40, **asks)))
        alone = await outputs_of(colocated.submit(request("lp", CHUNK + 40, **asks)))
    finally:
        await colocated.stop()
    for outs in (pd, alone):
        assert outs[-1].finish_reason == "length", outs[-1]
    assert [t for o in pd for t in o.token_ids] == [t for o in alone for t in o.token_ids]
    got, want = [e for o in pd for e in o.logprobs], [e for o in alone for e in o.logprobs]
    assert len(got) == len(want) == 5
    (got_prompt,) = [o.prompt_logprobs for o in pd if o.prompt_logprobs is not None]
    (want_prompt,) = [o.prompt_logprobs for o in alone if o.prompt_logprobs is not None]
    assert len(got_prompt) == len(want_prompt) == CHUNK + 40 - 5
    for mine, theirs in zip([*got, *got_prompt], [*want, *want_prompt], strict=True):
        assert mine.token_id == theirs.token_id and abs(mine.logprob - theirs.logprob) < 1e-5
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
        assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(mine.top, theirs.top, strict=True))
