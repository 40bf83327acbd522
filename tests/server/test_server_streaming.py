"""SSE framing, usage, mid-stream errors, and aborts when the client goes away."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from sse_reader import parse_sse

REPLY = "Hello from the fake engine."


async def wait_until(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


async def sse_events(response) -> list:
    assert response.status == 200, await response.text()
    assert response.headers["Content-Type"].startswith("text/event-stream")
    return parse_sse(await response.read())


async def test_completion_stream_frames_and_usage(client):
    body = {"prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}}
    events = await sse_events(await client.post("/v1/completions", json=body))
    *chunks, usage_chunk = events
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len({c["id"] for c in events}) == 1 and chunks[0]["object"] == "text_completion"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 2, "completion_tokens": len(REPLY),
                                    "total_tokens": 2 + len(REPLY), "prompt_tokens_details": {"cached_tokens": 0}}


async def test_completion_non_stream_truncated(client):
    response = await client.post("/v1/completions", json={"prompt": [72, 105], "max_tokens": 5})
    body = await response.json()
    assert body["choices"][0] == {"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length"}
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_generate_stream_and_whole(client, engine):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "stream": True}
    events = await sse_events(await client.post("/generate", json=body))
    assert "".join(e["text"] for e in events) == REPLY[:8]
    assert [i for e in events for i in e["output_ids"]] == [ord(c) for c in REPLY[:8]]
    assert events[-1]["meta_info"]["finish_reason"] == "length"
    assert events[-1]["meta_info"]["completion_tokens"] == 8
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert engine.submitted[-1].sampling.temperature == 0.0

    whole = await (await client.post("/generate", json={"text": "hey", "sampling_params": {"stop": "x"}})).json()
    assert whole["text"] == REPLY and whole["output_ids"] == [ord(c) for c in REPLY]
    meta = whole["meta_info"]
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == len(REPLY)
    assert meta["finish_reason"] == "stop" and meta["e2e_latency"] > 0
    assert engine.submitted[-1].sampling.stop == ("x",)


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 50}),
    ("/generate", {"text": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
async def test_engine_error_mid_stream_is_an_error_event_then_done(client, engine, route, body):
    engine.fail_after = 3
    events = await sse_events(await client.post(route, json={**body, "stream": True}))
    error = events[-1]["error"]
    assert error["message"] == "injected failure" and error["type"] == "server_error"
    assert not any("error" in e for e in events[:-1])

    response = await client.post(route, json=body)  # the same failure without streaming
    assert response.status == 500
    assert (await response.json())["error"]["message"] == "injected failure"


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 200}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 200}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_aborts_the_engine_request(client, engine, route, body, stream):
    engine.reply_for = lambda request: "z" * 200
    engine.token_delay = 0.02  # slow enough that the client leaves mid-generation
    url = client.make_url(route)
    async with aiohttp.ClientSession() as session:
        if stream:
            response = await session.post(url, json={**body, "stream": True})
            assert response.status == 200
            await response.content.readline()  # some tokens arrived
            response.close()  # drops the connection
        else:
            waiting = asyncio.create_task(session.post(url, json=body))
            await wait_until(lambda: engine.live, what="the request to reach the engine")
            waiting.cancel()  # drops the connection while the server waits for the result
            with pytest.raises(asyncio.CancelledError):
                await waiting
    await wait_until(lambda: engine.aborted, what="engine.abort")
    (rid, reason), = engine.aborted.items()
    assert reason == "client disconnected"
    assert rid == engine.submitted[-1].rid
    await wait_until(lambda: not engine.live, what="the engine to drop the request")
    metrics = await (await client.get("/metrics")).text()
    assert f'dsv4_http_client_disconnects_total{{route="{route}"}} 1.0' in metrics


async def test_finished_requests_are_not_aborted(client, engine):
    for stream in (True, False):
        response = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 50, "stream": stream})
        await response.read()
    assert len(engine.submitted) == 2 and not engine.aborted


async def test_deadline_comes_from_request_timeout(make_client, engine):
    client = await make_client(request_timeout=7.0)
    before = time.monotonic()
    await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert before + 7.0 <= engine.submitted[-1].deadline <= time.monotonic() + 7.0


async def test_stream_response_carries_request_id(client, engine):
    response = await client.post("/v1/completions", json={"prompt": "hi", "stream": True})
    await response.read()
    assert response.headers["X-Request-Id"] == engine.submitted[-1].rid


async def test_a_silent_engine_cannot_hold_the_client(make_client, engine, monkeypatch):
    monkeypatch.setattr("dsv4.server.engine_call.ENGINE_ANSWER_GRACE_SECONDS", 0.2)
    engine.token_delay = 30.0  # the engine says nothing for far longer than the deadline
    client = await make_client(request_timeout=0.1)
    response = await client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status == 500
    assert (await response.json())["error"]["code"] == "engine_timeout"
    await wait_until(lambda: engine.aborted, what="engine.abort")
