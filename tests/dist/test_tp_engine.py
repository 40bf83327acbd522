"""TP=2 serves what TP=1 serves (gloo on 127.0.0.1, all-reduces through shared memory where the ranks
share a node: dsv4/dist/shm_reduce.py; rank 0 in this process, rank 1 a child).

32 prompts of 1-600 tokens run concurrently through a TP=1 and a TP=2 engine with a 97-token
prefill budget (chunks end mid-window and mid-compression-group) and fewer slots than prompts.
Sums across ranks round differently from TP=1's, so where the two disagree the test passes only if
the reference's top-2 margin at the first differing step (given the prefix both agree on) is below
EPS: a genuine tie, as in tests/engine/test_engine_reference.py. Seeded sampling must agree exactly.
"""

import asyncio
import re
from pathlib import Path

import pytest
import torch

from dsv4.config import ModelConfig, ServerArgs
from dsv4.dist import shm_reduce
from dsv4.engine.engine import Engine
from dsv4.protocol import GenerationRequest, SamplingParams
from dsv4.reference.model import load_reference_model
from dsv4.tiny import make_tiny
from tests.engine.test_engine_reference import EPS, make_prompts, prompt_lengths

NEW_TOKENS = 8
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {preset: make_tiny(tmp_path_factory.mktemp(preset), preset=preset) for preset in ("tiny", "small")}


def engine_args(checkpoint, tp_size, index_key_dtype="fp32", **kw):
    kw = {"dist_timeout": 20, **kw}
    return ServerArgs(model=str(checkpoint), dtype="float32", index_key_dtype=index_key_dtype, tp_size=tp_size,
                      chunked_prefill_size=97, max_running_requests=8, max_total_tokens=128 * 48, **kw)


async def serve_all(args, prompts, sampling):
    """Every prompt at once through a fresh engine of `args`; the tokens of each."""
    engine = Engine.from_args(args)
    await engine.start()
    try:
        if args.tp_size > 1 and shm_reduce.supported():  # (the file is gone once the group has formed)
            assert engine._group.shared_memory and not list(Path("/dev/shm").glob("dsv4-tp-*"))
        async with asyncio.timeout(TIMEOUT_S):
            async def one(i, prompt):
                request = GenerationRequest(rid=f"r{i}", input_ids=tuple(prompt), sampling=sampling)
                outputs = [out async for out in engine.submit(request)]
                assert outputs[-1].finish_reason == "length", outputs[-1]
                return [t for out in outputs for t in out.token_ids]

            results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        debug = engine.debug_requests()
        assert debug["free_pages"] == debug["total_pages"] and debug["free_slots"] == debug["total_slots"]
        if args.tp_size > 1:
            assert debug["rank_ticks"] == [debug["tick"]] * args.tp_size
        return results
    finally:
        await engine.stop()


def greedy(n=NEW_TOKENS):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("index_key_dtype", ["fp8", "bf16"])
async def test_tp2_greedy_equals_tp1(checkpoints, preset, index_key_dtype):
    checkpoint = checkpoints[preset]
    prompts = make_prompts(prompt_lengths(), ModelConfig.from_json(checkpoint).vocab_size)
    tp1 = await serve_all(engine_args(checkpoint, 1, index_key_dtype), prompts, greedy())
    tp2 = await serve_all(engine_args(checkpoint, 2, index_key_dtype), prompts, greedy())
    ties = 0
    for i, (prompt, a, b) in enumerate(zip(prompts, tp1, tp2, strict=True)):
        step = next((s for s, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if step is None:
            continue
        margin = reference_margin(checkpoint, index_key_dtype, prompt + a[:step])
        assert margin < EPS, (f"{preset}/{index_key_dtype}: prompt {i} ({len(prompt)} tokens) step {step}: "
                              f"TP=1 {a[step]}, TP=2 {b[step]} (reference top-2 margin {margin:.3g})")
        ties += 1
    assert ties <= 2, f"{ties} prompts diverged at genuine ties: more than rounding explains"


async def test_seeded_sampling_equal_at_tp1_and_tp2(checkpoints):
    checkpoint = checkpoints["tiny"]
    prompts = make_prompts([3, 40, 130, 300], 512, seed=5)
    sampling = SamplingParams(max_new_tokens=16, temperature=0.8, seed=1234, ignore_eos=True)
    tp1 = await serve_all(engine_args(checkpoint, 1), prompts, sampling)
    tp2 = await serve_all(engine_args(checkpoint, 2), prompts, sampling)
    assert tp2 == tp1
    assert tp1 != await serve_all(engine_args(checkpoint, 1), prompts, greedy(16))  # sampling did sample


def reference_margin(checkpoint, index_key_dtype, tokens):
    """The reference's top-2 logit margin for the token after `tokens`."""
    model = load_reference_model(checkpoint, dtype=torch.float32, index_key_dtype=index_key_dtype)
    top = model(torch.tensor([tokens]))[0, -1].topk(2).values
    return (top[0] - top[1]).item()


async def test_rank_local_delays_at_every_phase_change_nothing(checkpoints):
    """Delays on either rank before the plan, inside the forward and before the consensus vector: the
    group stays in lockstep and serves exactly what it serves undelayed."""
    checkpoint = checkpoints["tiny"]
    prompts = make_prompts([1, 60, 129, 257, 600, 7], 512, seed=9)
    delays = ",".join(f"delay:rank{rank}:{phase}:0.3:30ms" for rank in (0, 1) for phase in ("plan", "forward",
                                                                                            "consensus"))
    calm = await serve_all(engine_args(checkpoint, 2), prompts, greedy())
    delayed = await serve_all(engine_args(checkpoint, 2, fault_inject=delays), prompts, greedy())
    assert delayed == calm


async def test_a_rank_past_the_collective_deadline_is_named_and_fatal(checkpoints):
    args = engine_args(checkpoints["tiny"], 2, fault_inject="delay:rank1:forward:1:4s", dist_timeout=2)
    engine = Engine.from_args(args)
    await engine.start()
    try:
        async with asyncio.timeout(30):
            outputs = [out async for out in engine.submit(
                GenerationRequest(rid="late", input_ids=(1, 2, 3), sampling=greedy()))]
            reason = await engine.until_dead()
        assert re.search(r"rank 1 did not reach all_reduce\([a-z.]+\) of tick \d+ within 2 s", reason), reason
        assert outputs[-1].finish_reason == "error" and reason in outputs[-1].error
        assert engine.ready() == (False, [reason])
    finally:
        await engine.stop()


async def test_abort_storm_under_tp2_leaks_nothing_and_outputs_stay_correct(checkpoints):
    """48 requests, most aborted at random moments (before admission, mid-prefill, mid-decode): none
    hangs, every page and slot comes back, both ranks stay in lockstep, and the next 64 requests
    serve exactly what TP=1 serves."""
    import random

    checkpoint = checkpoints["tiny"]
    rng = random.Random(3)
    engine = Engine.from_args(engine_args(checkpoint, 2))
    await engine.start()
    try:
        async with asyncio.timeout(TIMEOUT_S):
            async def doomed(i):
                prompt = make_prompts([rng.randint(1, 400)], 512, seed=i)[0]
                stream = engine.submit(GenerationRequest(rid=f"storm-{i}", input_ids=tuple(prompt),
                                                         sampling=greedy(64)))
                asyncio.get_running_loop().call_later(rng.uniform(0, 0.5), engine.abort, f"storm-{i}", "storm")
                return [out async for out in stream][-1]

            ends = await asyncio.gather(*(doomed(i) for i in range(48)))
            assert sum(end.finish_reason == "abort" for end in ends) > 24
            debug = engine.debug_requests()
            assert debug["free_pages"] == debug["total_pages"] and debug["free_slots"] == debug["total_slots"]
            assert engine.ready()[0] and debug["rank_ticks"] == [debug["tick"]] * 2
            prompts = make_prompts([rng.randint(1, 200) for _ in range(64)], 512, seed=11)

            async def after(i, prompt):
                stream = engine.submit(GenerationRequest(rid=f"after-{i}", input_ids=tuple(prompt),
                                                         sampling=greedy(4)))
                return [t async for out in stream for t in out.token_ids]

            served = await asyncio.gather(*(after(i, p) for i, p in enumerate(prompts)))
    finally:
        await engine.stop()
    assert served == await serve_all(engine_args(checkpoint, 1), prompts, greedy(4))
