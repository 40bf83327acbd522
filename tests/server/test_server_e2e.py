"""End to end against a real `python -m dsv4 serve` process on the tiny checkpoint."""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request

import aiohttp
import openai
import pytest
from live_server import LiveServer, live_servers

from dsv4 import chat
from dsv4.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(300)


# Tick 3's forward sleeps 4 s, as a wedged collective would; readiness must notice within 5 s.
STALL = ("--fault-inject", "stall_tick=4@3", "--tick-stall-timeout", "1")


@pytest.fixture(scope="module")
def servers(tiny_ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("servers")
    with live_servers(LiveServer(tiny_ckpt, logs / "plain.log"), LiveServer(tiny_ckpt, logs / "stall.log", *STALL)) as s:
        yield s


@pytest.fixture(scope="module")
def server(servers) -> str:
    return servers[0].base


@pytest.fixture(scope="module")
def stalling_server(servers) -> str:
    return servers[1].base


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt) -> Tokenizer:
    return Tokenizer.from_dir(tiny_ckpt)


def openai_client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60, max_retries=0)


def metric_value(exposition: str, sample: str) -> float:
    for line in exposition.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {sample} in /metrics")


async def poll(check, timeout: float, what: str, period: float = 0.1):
    """Calls the async `check` until it returns something truthy; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(period)


def generate(base: str, body: dict) -> dict:
    request = urllib.request.Request(f"{base}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_openai_client_streams_a_chat_completion(server, tokenizer):
    client = openai_client(server)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Paris today?"}]
    # The random tiny model may well write DSML, which the chat parser rightly rejects as malformed
    # markup; stopping on that id keeps its reply plain text. Think markers it writes are stray in
    # chat mode: they count as tokens but their text is dropped.
    markers = [tokenizer.dsml_id]
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "stop_token_ids": markers},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish_reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    prompt_ids = tokenizer.encode(chat.encode_messages(messages))
    assert usage.prompt_tokens == len(prompt_ids)
    # The same greedy continuation through the native API names the tokens behind the stream.
    native = generate(server, {"input_ids": prompt_ids, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "stop_token_ids": markers}})
    assert usage.completion_tokens == len(native["output_ids"]) == native["meta_info"]["completion_tokens"]
    assert content == native["text"].replace("<think>", "").replace("</think>", "")
    assert finish_reasons == [native["meta_info"]["finish_reason"]]


def test_openai_client_streams_a_completion(server, tokenizer):
    client = openai_client(server)
    model = client.models.list().data[0].id
    prompt = "The quick brown fox"
    chunks = list(client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert usage.completion_tokens == 12
    native = generate(server, {"text": prompt, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})
    assert len(native["output_ids"]) == 12 and native["text"] == text
    assert native["meta_info"]["prompt_tokens"] == usage.prompt_tokens


async def test_abort_storm_leaves_nothing_behind(server):
    """100 streams, half dropped at random points; then every page and slot is free again."""
    rng = random.Random(1234)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog"]

    async def one(session: aiohttp.ClientSession, i: int, cancel: bool) -> str:
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(3, 30)))
        body = {"prompt": prompt, "max_tokens": rng.randint(4, 12), "stream": True, "ignore_eos": True,
                "temperature": 0.8, "seed": i}
        drop_after = rng.randint(0, 6) if cancel else None
        async with session.post(f"{server}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            lines = 0
            async for line in response.content:
                if line.strip():
                    lines += 1
                if drop_after is not None and lines >= drop_after:
                    response.close()  # the connection goes, mid-stream
                    return "dropped"
                if line.strip() == b"data: [DONE]":
                    return "done"
        return "ended"

    async def dropped_before_headers(session: aiohttp.ClientSession, i: int) -> str:
        task = asyncio.create_task(one(session, i, cancel=False))
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            return "cancelled"

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        jobs = []
        for i in range(100):
            if i % 2 == 0:
                jobs.append(one(session, i, cancel=False))
            elif i % 4 == 1:
                jobs.append(one(session, i, cancel=True))
            else:
                jobs.append(dropped_before_headers(session, i))
        outcomes = await asyncio.wait_for(asyncio.gather(*jobs), timeout=150)
        assert outcomes[::2] == ["done"] * 50

        async def drained():
            async with session.get(f"{server}/debug/requests") as response:
                state = await response.json()
            idle = (not state["requests"] and state["free_pages"] == state["total_pages"]
                    and state["free_slots"] == state["total_slots"])
            return state if idle else None

        await poll(drained, timeout=30, what="every page and slot to be free")
        async with session.get(f"{server}/metrics") as response:
            metrics = await response.text()
        aborted = metric_value(metrics, 'dsv4_finished_requests_total{reason="abort"}')
        assert aborted >= 10, "the storm should abort running requests in the engine"
        async with session.get(f"{server}/health/ready") as response:
            assert response.status == 200, await response.text()
        async with session.post(f"{server}/v1/completions", json={"prompt": "Hello", "max_tokens": 3}) as response:
            assert response.status == 200
            assert (await response.json())["usage"]["completion_tokens"] >= 1


async def test_readiness_fails_while_the_tick_loop_is_stalled(stalling_server):
    base = stalling_server
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        body = {"prompt": "Hello there", "max_tokens": 8, "ignore_eos": True}
        pending = asyncio.create_task(session.post(f"{base}/v1/completions", json=body))

        async def readiness(expected: int):
            async with session.get(f"{base}/health/ready") as response:
                return await response.json() if response.status == expected else None

        not_ready = await poll(lambda: readiness(503), timeout=5, what="/health/ready to turn 503")
        assert any("has not completed" in reason for reason in not_ready["reasons"]), not_ready
        await poll(lambda: readiness(200), timeout=20, what="/health/ready to recover")
        response = await asyncio.wait_for(pending, timeout=30)
        assert response.status == 200
        assert (await response.json())["choices"][0]["finish_reason"] == "length"
