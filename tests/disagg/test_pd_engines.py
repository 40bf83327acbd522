"""A PD pair of real engines (tiny checkpoint) in this process, over UCX on 127.0.0.1: per-request
failures on the prefill side end that request with its reason and status, and the pair stays ready
and serves what follows (ARCHITECTURE.md invariant 5)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import pytest_asyncio
from conftest import wait_until

from dsv4.config import ServerArgs
from dsv4.engine.engine import Engine
from dsv4.engine.launch import load_model
from dsv4.engine.pd import PdEngine
from dsv4.engine.request import AdmissionError
from dsv4.protocol import GenerationRequest, SamplingParams

PREFILL_CONTEXT = 256  # smaller than the decode side's
VICTIM_LAYER, VICTIM_ROW, CHUNK = 1, 5, 128  # tiny: layer 1 is CSA


def engine_of(checkpoint, **overrides) -> Engine:
    args = ServerArgs(**{"model": str(checkpoint), "max_running_requests": 8, "max_total_tokens": 128 * 32,
                         "chunked_prefill_size": CHUNK, "dtype": "float32", **overrides})
    model = load_model(args)
    return Engine(args, model.config, model.tokenizer, model.runner, model_name=model.name), args


@pytest_asyncio.fixture(loop_scope="session")
async def make_pd(tiny_ckpt):
    """`await make_pd(faults)`: (prefill, decode), built on the test's loop, stopped after."""
    started = []

    async def make(faults: str | None = None):
        prefill_engine, prefill_args = engine_of(tiny_ckpt, context_length=PREFILL_CONTEXT, verify_indexer="fail",
                                                 disaggregation_mode="prefill", disaggregation_bootstrap_port=0,
                                                 fault_inject=faults)
        prefill = PdEngine(prefill_engine, prefill_args)
        await prefill.start()
        started.append(prefill)
        decode_engine, decode_args = engine_of(tiny_ckpt, disaggregation_mode="decode",
                                               prefill_addr=(f"127.0.0.1:{prefill.side.port}",))
        decode = PdEngine(decode_engine, decode_args)
        await decode.start()
        started.append(decode)
        await wait_until(lambda: decode.ready()[0], 20, "the decode side", explain=lambda: decode.ready()[1])
        return prefill, decode

    yield make
    for service in reversed(started):
        await asyncio.wait_for(service.stop(), 15)


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
