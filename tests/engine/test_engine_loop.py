"""The engine's tick loop over a scripted runner: batching, aborts, deadlines, supervision, readiness."""

import asyncio
import random
import time

import pytest
from fakes import ScriptedRunner, fake_greedy, next_token

from dsv4.config import ServerArgs
from dsv4.engine.engine import Engine
from dsv4.engine.request import AdmissionError
from dsv4.protocol import GenerationRequest, SamplingParams
from dsv4.tiny import tiny_config
from dsv4.tokenizer import Tokenizer

P = 128


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return Tokenizer.from_dir(tiny_tokenizer_dir)


@pytest.fixture
async def make_engine(tokenizer):
    engines = []

    async def make(forward_delay=0.0, **overrides):
        args = ServerArgs(**{"page_size": P, "max_running_requests": 4, "max_total_tokens": 16 * P,
                             "chunked_prefill_size": 48, **overrides})
        cfg = tiny_config("tiny", 512)
        runner = ScriptedRunner(vocab=cfg.vocab_size, num_pages=args.max_total_tokens // P,
                                num_slots=args.max_running_requests, page_size=P,
                                avoid=frozenset({tokenizer.eos_id, cfg.eos_token_id}), forward_delay=forward_delay)
        engine = Engine(args, cfg, tokenizer, runner)
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop()


def greedy_request(rid, prompt, max_new=6, **sampling):
    return GenerationRequest(rid=rid, input_ids=tuple(prompt),
                             sampling=SamplingParams(max_new_tokens=max_new, temperature=0.0, **sampling))


async def collect(stream):
    return [out async for out in stream]


async def wait_until(predicate, timeout=5.0):
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def all_free(engine):
    d = engine.debug_requests()
    return not d["requests"] and d["free_pages"] == d["total_pages"] and d["free_slots"] == d["total_slots"]


async def test_concurrent_requests_match_greedy_whatever_the_batching(make_engine):
    engine = await make_engine()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 300))] for _ in range(12)]
    async with asyncio.timeout(30):
        results = await asyncio.gather(*(collect(engine.submit(greedy_request(f"r{i}", p))) for i, p in enumerate(prompts)))
    avoid = engine.runner.avoid
    for prompt, outputs in zip(prompts, results):
        tokens = [t for out in outputs for t in out.token_ids]
        assert tokens == fake_greedy(prompt, 6, engine.model_config.vocab_size, avoid)
        assert outputs[-1].finished and outputs[-1].finish_reason == "length"
        assert "".join(o.text for o in outputs) == engine.tokenizer.decode(tokens, skip_special=True)
    await wait_until(lambda: all_free(engine))
    sample = engine.metrics.registry.get_sample_value
    assert sample("dsv4_generation_tokens_total") == 12 * 6
    assert sample("dsv4_prompt_tokens_total") == sum(map(len, prompts))
    assert sample("dsv4_finished_requests_total", {"reason": "length"}) == 12


async def test_capacity_gauges_show_the_scheduler_when_scraped(make_engine):
    """The gauges are read at render time: while requests run, and after they end, they show the
    scheduler's state of that moment (not that of the last tick, which runs only while there is work)."""
    engine = await make_engine(forward_delay=0.02, max_running_requests=2)
    sample = engine.metrics.registry.get_sample_value
    assert (sample("dsv4_free_pages"), sample("dsv4_total_pages"), sample("dsv4_free_slots"),
            sample("dsv4_total_slots"), sample("dsv4_running_requests"), sample("dsv4_waiting_requests")) == (
        16, 16, 2, 2, 0, 0)
    streams = [asyncio.ensure_future(collect(engine.submit(greedy_request(f"g{i}", [3] * 200, max_new=30))))
               for i in range(3)]
    await wait_until(lambda: len(engine.scheduler.running) == 2)
    assert sample("dsv4_running_requests") == 2 and sample("dsv4_waiting_requests") == 1
    assert sample("dsv4_free_slots") == 0 and sample("dsv4_free_pages") == engine.scheduler.capacity()["free_pages"] < 16
    async with asyncio.timeout(30):
        await asyncio.gather(*streams)
    await wait_until(lambda: all_free(engine))
    assert (sample("dsv4_free_pages"), sample("dsv4_free_slots"), sample("dsv4_running_requests"),
            sample("dsv4_waiting_requests")) == (16, 2, 0, 0)


async def test_aborts_at_random_points_free_every_page_and_slot(make_engine):
    engine = await make_engine(forward_delay=0.002)
    rng = random.Random(1)

    async def client(i):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 400))]
        stream = engine.submit(greedy_request(f"a{i}", prompt, max_new=40))
        stop_after = rng.choice([0, 0, 1, 3, 10, 100])
        if stop_after == 0:
            engine.abort(f"a{i}", "test abort")
        outputs = []
        async for out in stream:
            outputs.append(out)
            if len(outputs) == stop_after:
                break  # closing the stream aborts the request, like a disconnect
        await stream.aclose()
        if outputs and outputs[-1].finish_reason == "abort":  # released before its last output
            assert f"a{i}" not in engine.allocator.pages.holders()
        return outputs

    async with asyncio.timeout(30):
        results = await asyncio.gather(*(client(i) for i in range(24)))
    assert any(outs and outs[-1].finish_reason == "abort" for outs in results)
    await wait_until(lambda: all_free(engine))
    assert engine.ready() == (True, [])


async def test_deadline_expiry_ends_a_request_with_an_error(make_engine):
    engine = await make_engine(forward_delay=0.01)
    req = GenerationRequest(rid="slow", input_ids=(5, 6, 7), deadline=time.monotonic() + 0.2,
                            sampling=SamplingParams(max_new_tokens=1000, temperature=0.0))
    async with asyncio.timeout(5):
        outputs = await collect(engine.submit(req))
    assert outputs[-1].finish_reason == "error" and "deadline" in outputs[-1].error
    assert 0 < len([o for o in outputs if o.token_ids]) < 1000
    await wait_until(lambda: all_free(engine))


async def test_stall_makes_the_engine_not_ready_within_the_bound_and_it_recovers(make_engine):
    engine = await make_engine(forward_delay=0.005, tick_stall_timeout=0.3, fault_inject="stall_tick=1.5@3")
    stream = engine.submit(greedy_request("s", [9] * 10, max_new=20))
    started = time.monotonic()
    await wait_until(lambda: not engine.ready()[0], timeout=1.0)
    assert time.monotonic() - started < 0.3 + 0.1 + 0.3  # stall starts at tick 3; bound 0.3 s; polling slack
    assert "has not completed" in engine.ready()[1][0]
    assert engine.debug_requests()["tick"] == 2  # /debug still answers while the forward is stuck
    async with asyncio.timeout(5):
        outputs = await collect(stream)
    assert outputs[-1].finish_reason == "length"
    assert engine.ready() == (True, [])


async def test_a_dead_tick_loop_is_reported_and_fails_requests(make_engine):
    engine = await make_engine(fault_inject="crash_tick=2")
    async with asyncio.timeout(5):
        outputs = await collect(engine.submit(greedy_request("c", [4, 5], max_new=5)))
    assert outputs[-1].finish_reason == "error" and "injected crash" in outputs[-1].error
    ok, reasons = engine.ready()
    assert not ok and "tick loop died at tick 2" in reasons[0]
    async with asyncio.timeout(5):
        late = await collect(engine.submit(greedy_request("late", [4], max_new=2)))
    assert late[-1].finish_reason == "error"


async def test_a_forward_past_its_deadline_kills_the_tick_loop_with_its_name(make_engine):
    """A forward stuck past FORWARD_DEADLINE_STALLS stall bounds (0.6 s here) ends the tick loop with the tick
    named; its requests fail with that reason at once, though the forward thread is still stuck."""
    engine = await make_engine(forward_delay=0.002, tick_stall_timeout=0.05, fault_inject="stall_tick=3@3")
    started = time.monotonic()
    async with asyncio.timeout(2.5):
        outputs = await collect(engine.submit(greedy_request("d", [4, 5], max_new=20)))
    assert time.monotonic() - started < 2.0  # the forward itself would take 3 s more
    final = outputs[-1]
    assert final.finish_reason == "error" and final.error_status == 503, final
    assert "forward of tick 3 did not return within 1 s" in final.error, final.error
    ok, reasons = engine.ready()
    assert not ok and "tick loop died at tick 3" in reasons[0], reasons


async def test_queue_wait_bound_makes_the_engine_not_ready(make_engine):
    engine = await make_engine(forward_delay=0.05, max_running_requests=1, chunked_prefill_size=1, max_queue_wait=0.1)
    first = asyncio.create_task(collect(engine.submit(greedy_request("first", [3], max_new=8))))
    second = asyncio.create_task(collect(engine.submit(greedy_request("second", [3], max_new=1))))
    await wait_until(lambda: not engine.ready()[0], timeout=2.0)
    assert "oldest waiting request" in engine.ready()[1][0]
    async with asyncio.timeout(5):
        await asyncio.gather(first, second)
    assert engine.ready() == (True, [])


async def test_idle_engine_does_not_tick(make_engine):
    engine = await make_engine()
    async with asyncio.timeout(5):
        await collect(engine.submit(greedy_request("x", [3, 4], max_new=2)))
    await wait_until(lambda: all_free(engine))
    ticks = engine.debug_requests()["tick"]
    await asyncio.sleep(0.3)
    assert engine.debug_requests()["tick"] == ticks


async def test_stop_strings_and_admission_errors(make_engine):
    engine = await make_engine()
    prompt = [3, 4, 5]
    tokens = fake_greedy(prompt, 8, engine.model_config.vocab_size, engine.runner.avoid)
    expected = engine.tokenizer.decode(tokens, skip_special=True)
    stop = expected[3:5]
    async with asyncio.timeout(5):
        outputs = await collect(engine.submit(greedy_request("st", prompt, max_new=8, stop=(stop,))))
    text = "".join(o.text for o in outputs)
    assert outputs[-1].finish_reason == "stop" and text == expected[: expected.index(stop)]
    with pytest.raises(AdmissionError, match="context limit|pool has"):
        engine.submit(greedy_request("huge", [3] * 100, max_new=16 * P))
    with pytest.raises(AdmissionError, match="token ids"):
        engine.submit(greedy_request("oov", [10**6]))


async def test_a_requests_error_ends_that_request_alone(make_engine, monkeypatch):
    """ARCHITECTURE.md invariant 5: a request whose text state cannot be set up (admission), a
    sampler that fails for one request's parameters (sampling) and a detokenizer that fails on one
    request's text (delivery) each end that request with its cause; the others finish and the
    engine stays ready."""
    engine = await make_engine()
    from dsv4.engine import tick

    real_sample = tick.sample

    def sample_refusing_top_k_7(logits, params, *args):
        if any(p.top_k == 7 for p in params):
            raise ValueError("no sampler takes top_k 7")
        return real_sample(logits, params, *args)

    monkeypatch.setattr(tick, "sample", sample_refusing_top_k_7)
    real_detokenizer = engine._ticker._new_detokenizer

    class FailsOnPush:
        def push(self, token):
            raise UnicodeError("cannot decode this request's bytes")

    def no_detokenizer():
        raise MemoryError("no room for this request's text state")

    factories = iter([FailsOnPush, no_detokenizer])  # in admission order: "detok", then "admit"
    monkeypatch.setattr(engine._ticker, "_new_detokenizer", lambda: next(factories, real_detokenizer)())
    broken = [
        GenerationRequest(rid="detok", input_ids=(5, 6, 7), sampling=SamplingParams(max_new_tokens=4, temperature=0)),
        GenerationRequest(rid="admit", input_ids=(5, 6, 8), sampling=SamplingParams(max_new_tokens=4, temperature=0)),
        GenerationRequest(rid="topk", input_ids=(5, 6, 7),
                          sampling=SamplingParams(max_new_tokens=4, temperature=0.7, top_k=7, seed=1)),
    ]
    healthy = [greedy_request(f"ok{i}", [9, i + 3, 4]) for i in range(5)]
    async with asyncio.timeout(30):
        results = await asyncio.gather(*(collect(engine.submit(r)) for r in [*broken, *healthy]))
    for req, outputs, cause in zip(broken, results, ("UnicodeError", "MemoryError", "ValueError")):
        final = outputs[-1]
        assert final.finished and final.finish_reason == "error", (req.rid, final)
        assert final.error_status == 500 and "engine went on" in final.error and cause in final.error, final.error
    for req, outputs in zip(healthy, results[len(broken):]):
        tokens = [t for out in outputs for t in out.token_ids]
        assert tokens == fake_greedy(list(req.input_ids), 6, engine.model_config.vocab_size, engine.runner.avoid)
    await wait_until(lambda: all_free(engine))
    assert engine.ready() == (True, [])
    sample = engine.metrics.registry.get_sample_value
    assert {s: sample("dsv4_request_errors_total", {"stage": s}) for s in ("admit", "sample", "deliver")} == {
        "admit": 1, "sample": 1, "deliver": 1}
    async with asyncio.timeout(10):
        outputs = await collect(engine.submit(greedy_request("after", [3, 4, 5])))
    assert outputs[-1].finish_reason == "length"


async def test_logits_processors_apply_through_the_tick(make_engine):
    """The tick hands each request's token history to the sampler: a bias forces a token, and a
    presence penalty takes the scripted logits where a plain simulation of it goes."""
    engine = await make_engine()
    forced = GenerationRequest(rid="bias", input_ids=(5, 6, 7), sampling=SamplingParams(
        max_new_tokens=5, temperature=0.0, ignore_eos=True, logit_bias=((42, 10.0),)))
    fresh = GenerationRequest(rid="presence", input_ids=(5, 6, 7), sampling=SamplingParams(
        max_new_tokens=40, temperature=0.0, ignore_eos=True, presence_penalty=-5.0))
    plain = greedy_request("plain", [5, 6, 7], max_new=40, ignore_eos=True)
    async with asyncio.timeout(30):
        results = await asyncio.gather(*(collect(engine.submit(r)) for r in (forced, fresh, plain)))
    tokens = [[t for out in outputs for t in out.token_ids] for outputs in results]
    assert tokens[0] == [42] * 5
    vocab, avoid = engine.model_config.vocab_size, engine.runner.avoid
    history, expected = [5, 6, 7], []
    for _ in range(40):  # the scripted runner's logits: 4.0 on next_token, 0 elsewhere
        scores = [0.0] * vocab
        scores[next_token(history, vocab, avoid)] = 4.0
        for t in set(expected):
            scores[t] -= -5.0  # a negative presence penalty favours what was generated
        expected.append(max(range(vocab), key=scores.__getitem__))
        history.append(expected[-1])
    assert tokens[1] == expected
    assert tokens[2] == fake_greedy([5, 6, 7], 40, vocab, avoid) != expected
