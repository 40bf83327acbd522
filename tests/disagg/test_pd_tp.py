"""PD with TP=2 on both sides, on 127.0.0.1 (gloo within a group, UCX between them): a prefill group
of two processes (`python -m dsv4 serve --tp-size 2 --disaggregation-mode prefill`) and a decode group
whose rank 0 is this process (its rank 1 a child). Each transfer's state is installed on both decode
ranks through the plan and adopted only once the consensus vector shows it landed on both; the
outputs equal a colocated TP=1 engine's (up to genuine ties, as in tests/dist/test_tp_engine.py).
Every wait is bounded; every process started here is stopped.
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest
from pd_helpers import held, wait_until
from pd_processes import Server, free_port, get_json
from test_pd_engines import outputs_of

from dsv4.config import ServerArgs
from dsv4.engine.engine import Engine
from dsv4.engine.pd import PdEngine
from dsv4.protocol import GenerationRequest, SamplingParams
from tests.dist.test_tp_engine import reference_margin
from tests.engine.test_engine_reference import EPS, make_prompts

COMMON = {"dtype": "float32", "index_key_dtype": "fp32", "max_running_requests": 16, "max_total_tokens": 128 * 96,
          "chunked_prefill_size": 256, "dist_timeout": 20}
pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def prefill(tiny_ckpt, tmp_path_factory):
    """The prefill group: rank 0 serves UCX (and HTTP, for its debug view and readiness)."""
    server = Server("prefill-tp2", tmp_path_factory.mktemp("pd-tp"), "--model", str(tiny_ckpt),
                    *(f"--{k.replace('_', '-')}={v}" for k, v in COMMON.items()), "--tp-size", "2",
                    "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(free_port()))
    server.start()
    try:
        asyncio.run(server.wait_ready(180))
        yield server
    finally:
        server.stop()


def bootstrap_port(server: Server) -> int:
    return int(server.args[server.args.index("--disaggregation-bootstrap-port") + 1])


async def start_decode(tiny_ckpt, prefill: Server) -> PdEngine:
    args = ServerArgs(model=str(tiny_ckpt), tp_size=2, disaggregation_mode="decode",
                      prefill_addr=(f"127.0.0.1:{bootstrap_port(prefill)}",), **COMMON)
    decode = PdEngine(Engine.from_args(args), args)
    await decode.start()
    try:
        await wait_until(lambda: decode.ready()[0], 30, "the decode group", explain=lambda: decode.ready()[1])
    except BaseException:
        await asyncio.wait_for(decode.stop(), 30)
        raise
    return decode


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


async def serve(engine, prompts, sampling, tag: str, timeout: float = 240) -> list[list[int]]:
    async def one(i, prompt):
        outs = await outputs_of(engine.submit(GenerationRequest(rid=f"{tag}-{i}", input_ids=tuple(prompt),
                                                                sampling=sampling)), timeout)
        assert outs[-1].finish_reason == "length", outs[-1]
        return [t for o in outs for t in o.token_ids]

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


async def colocated_tp1(tiny_ckpt, prompts, sampling) -> list[list[int]]:
    engine = Engine.from_args(ServerArgs(model=str(tiny_ckpt), **COMMON))
    await engine.start()
    try:
        return await serve(engine, prompts, sampling, "colocated")
    finally:
        await engine.stop()


def assert_equal_up_to_ties(tiny_ckpt, prompts, got, want) -> None:
    ties = 0
    for i, (prompt, a, b) in enumerate(zip(prompts, want, got, strict=True)):
        step = next((s for s, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if step is not None:
            margin = reference_margin(tiny_ckpt, "fp32", prompt + a[:step])
            assert margin < EPS, f"prompt {i} step {step}: TP=1 {a[step]}, PD TP=2 {b[step]} (margin {margin:.3g})"
            ties += 1
    assert ties <= 2, f"{ties} prompts diverged at genuine ties: more than rounding explains"


async def assert_idle_and_ready(decode: PdEngine, prefill: Server) -> None:
    """Nothing held on either side, both groups in lockstep, both ready, no lease fenced."""
    await wait_until(lambda: not any(held(decode).values()), 20, "the decode side to release everything",
                     explain=lambda: held(decode))
    debug = decode.debug_requests()
    assert debug["rank_ticks"] == [debug["tick"]] * 2
    assert decode.ready() == (True, []), decode.ready()
    assert decode.side.metrics.sample("dsv4_pd_fenced_leases") == 0  # every abort was acknowledged
    async with aiohttp.ClientSession() as session:
        async def prefill_idle():
            _, d = await get_json(session, f"{prefill.url}/debug/requests")
            return d

        end = time.monotonic() + 20
        while (d := await prefill_idle())["free_pages"] != d["total_pages"] or d["disaggregation"]["transfers"]:
            assert time.monotonic() < end, d
            await asyncio.sleep(0.1)
        assert d["free_slots"] == d["total_slots"] and d["rank_ticks"] == [d["tick"]] * 2, d
        status, _ = await get_json(session, f"{prefill.url}/health/ready")
        assert status == 200
        async with session.get(f"{prefill.url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            fenced = [line for line in (await r.text()).splitlines() if line.startswith("dsv4_pd_fenced_leases_total")]
        assert fenced and all(float(line.split()[-1]) == 0 for line in fenced), fenced


async def test_pd_tp2_greedy_equals_colocated_tp1_and_a_rank_local_install_failure_fails_its_request(
        tiny_ckpt, prefill):
    prompts = make_prompts([1, 5, 127, 128, 129, 200, 255, 300, 400, 513, 37, 90], 500, seed=21)
    want = await colocated_tp1(tiny_ckpt, prompts, greedy(8))
    decode = await start_decode(tiny_ckpt, prefill)
    try:
        got = await serve(decode, prompts, greedy(8), "pd")
        assert_equal_up_to_ties(tiny_ckpt, prompts, got, want)
        # Rank 0's copy of one install fails (rank 1's lands): the consensus vector says it did not
        # land on every rank, so that request fails alone and is never adopted.
        pools = decode.engine.runner.pools
        write_slot = pools.write_slot

        def fail_once(*args):
            pools.write_slot = write_slot
            raise RuntimeError("injected: this rank's copy failed")

        pools.write_slot = fail_once
        outs = await outputs_of(decode.submit(GenerationRequest(rid="unlanded", input_ids=tuple(prompts[3]),
                                                                sampling=greedy(8))), 60)
        assert outs[-1].finish_reason == "error" and "did not land on every rank" in outs[-1].error, outs[-1]
        assert outs[-1].completion_tokens == 0
        await assert_idle_and_ready(decode, prefill)
        assert await serve(decode, prompts[:4], greedy(8), "after") == got[:4]
    finally:
        await asyncio.wait_for(decode.stop(), 30)


async def test_abort_storm_under_pd_tp2_leaks_nothing_and_outputs_stay_correct(tiny_ckpt, prefill):
    """48 requests aborted at random moments (waiting for a destination, mid-prefill, mid-transfer,
    mid-install, mid-decode): none hangs, both sides give everything back with every abort
    acknowledged, both groups stay in lockstep and ready, and the next 64 outputs equal colocated TP=1's."""
    rng = random.Random(7)
    decode = await start_decode(tiny_ckpt, prefill)
    try:
        async def doomed(i):
            prompt = make_prompts([rng.randint(1, 300)], 500, seed=100 + i)[0]
            stream = decode.submit(GenerationRequest(rid=f"storm-{i}", input_ids=tuple(prompt), sampling=greedy(64)))
            asyncio.get_running_loop().call_later(rng.uniform(0, 5), decode.abort, f"storm-{i}", "storm")
            return (await outputs_of(stream, 120))[-1]

        ends = await asyncio.gather(*(doomed(i) for i in range(48)))
        aborted = sum(end.finish_reason == "abort" for end in ends)
        assert aborted > 24, [end.finish_reason for end in ends]
        assert all(end.finish_reason in ("abort", "length") for end in ends), [e.error for e in ends if e.error]
        await assert_idle_and_ready(decode, prefill)
        prompts = make_prompts([rng.randint(1, 200) for _ in range(64)], 500, seed=11)
        got = await serve(decode, prompts, greedy(4), "after")
        await assert_idle_and_ready(decode, prefill)
    finally:
        await asyncio.wait_for(decode.stop(), 30)
    print(f"PD TP=2 abort storm: {aborted} of 48 aborted, tokens {sorted(e.completion_tokens for e in ends)}")
    assert_equal_up_to_ties(tiny_ckpt, prompts, got, await colocated_tp1(tiny_ckpt, prompts, greedy(4)))
