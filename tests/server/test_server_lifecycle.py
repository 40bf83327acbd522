"""The server's own lifecycle over the fake engine: liveness that follows the engine, draining for
shutdown, and connection hygiene (disconnects while sending are 499, slow bodies are 408)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import pytest

from dsv4.server.lifecycle import drain
from dsv4.server.state import LIFECYCLE

HELLO = {"messages": [{"role": "user", "content": "hi"}]}


async def wait_until(predicate, timeout=5.0, what="condition"):
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def metric(exposition: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in exposition.splitlines() if line.startswith(prefix))


async def test_liveness_fails_once_the_engine_is_dead(client, engine):
    assert (await client.get("/health")).status == 200
    engine.die("tick loop died at tick 7: RuntimeError: boom")
    response = await client.get("/health")
    assert response.status == 503
    assert (await response.json()) == {"status": "dead", "reason": "tick loop died at tick 7: RuntimeError: boom"}


async def test_draining_refuses_new_requests_and_is_not_ready(client, engine):
    engine.reply_for = lambda request: "z" * 100
    engine.token_delay = 0.02
    running = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100}))
    await wait_until(lambda: engine.live)
    lifecycle = client.server.app[LIFECYCLE]
    draining = asyncio.create_task(drain(lifecycle, engine, shutdown_timeout=10.0))
    await wait_until(lambda: lifecycle.draining)
    refused = await client.post("/v1/chat/completions", json=HELLO)
    assert refused.status == 503 and (await refused.json())["error"]["code"] == "shutting_down"
    ready = await client.get("/health/ready")
    assert ready.status == 503 and "shutting down" in (await ready.json())["reasons"][0]
    assert (await client.get("/health")).status == 200  # draining is not dead
    finished = await running  # the request in flight finished within the timeout
    assert finished.status == 200 and (await finished.json())["choices"][0]["text"] == "z" * 100
    async with asyncio.timeout(5):
        await draining
    assert engine.stopped == "the server is shutting down"


async def test_draining_ends_what_cannot_finish_in_time(client, engine):
    engine.reply_for = lambda request: "z" * 200
    engine.token_delay = 0.05
    stream = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 200, "stream": True})
    whole = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 200}))
    await wait_until(lambda: len(engine.live) == 2, what="two live requests")
    lifecycle = client.server.app[LIFECYCLE]
    async with asyncio.timeout(5):
        await drain(lifecycle, engine, shutdown_timeout=1.5)
    body = await stream.read()
    assert body.endswith(b"data: [DONE]\n\n")
    assert b'"error"' in body.rsplit(b"data: ", 2)[-2]  # an error event just before [DONE]
    response = await whole
    assert response.status >= 500 and "shutting down" in (await response.json())["error"]["message"]
    assert lifecycle.in_flight == 0


async def test_a_client_that_leaves_mid_stream_is_counted_as_499(client, engine, caplog):
    engine.reply_for = lambda request: "z" * 200
    engine.token_delay = 0.02
    caplog.set_level(logging.INFO, logger="dsv4.server")
    response = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 200, "stream": True})
    await response.content.readline()
    response.close()
    await wait_until(lambda: client.server.app[LIFECYCLE].in_flight == 0)
    metrics = await (await client.get("/metrics")).text()
    assert metric(metrics, 'dsv4_http_requests_total{method="POST",route="/v1/completions",status="499"}') == 1
    assert metric(metrics, 'dsv4_http_requests_total{method="POST",route="/v1/completions",status="200"}') == 0
    assert any("went away" in r.message and r.levelno == logging.INFO for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def _raw_connection(client) -> socket.socket:
    sock = socket.create_connection((client.host, client.port), timeout=5)
    return sock


async def test_a_client_that_leaves_while_sending_its_body_is_499_at_info(client, engine, caplog):
    caplog.set_level(logging.INFO, logger="dsv4.server")
    sock = _raw_connection(client)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"prompt\": \"hel")
    await asyncio.sleep(0.2)
    sock.close()
    async def counted():
        metrics = await (await client.get("/metrics")).text()
        return metric(metrics, 'dsv4_http_requests_total{method="POST",route="/v1/completions",status="499"}')
    async with asyncio.timeout(5):
        while not await counted():
            await asyncio.sleep(0.05)
    assert not engine.submitted
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert (await client.get("/health/ready")).status == 200


async def test_a_body_that_never_completes_is_408(make_client, engine):
    client = await make_client(body_read_timeout=0.5)
    sock = _raw_connection(client)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"text\": ")
    loop = asyncio.get_running_loop()
    reply = await asyncio.wait_for(loop.run_in_executor(None, sock.recv, 4096), 5)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"Connection: close" in reply
    sock.close()
    assert not engine.submitted


@pytest.mark.parametrize("route", ["/v1/completions", "/generate"])
async def test_prompts_too_long_to_fit_are_refused_before_tokenising(client, engine, route, monkeypatch):
    def never(text):
        raise AssertionError("tokenised a prompt that cannot fit")

    monkeypatch.setattr(engine.tokenizer, "encode", never)
    monkeypatch.setattr(engine.tokenizer, "encode_without_gil", never)
    body = {"prompt": "x" * 60_000} if route == "/v1/completions" else {"text": "x" * 60_000}
    response = await client.post(route, json=body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == "context_length_exceeded" and "60000 characters" in error["message"]


async def test_long_prompts_are_tokenised_off_the_event_loop(client, engine, monkeypatch):
    """A prompt that may fit but is long is tokenised on a worker thread (through the tokenizer's
    entry point that releases the GIL), so the loop keeps answering; short ones stay inline."""
    engine.max_context = 100_000
    threads = []

    def record(name):
        real = getattr(engine.tokenizer, name)

        def tokenize(text):
            threads.append((name, threading.current_thread() is threading.main_thread()))
            return real(text)
        return tokenize

    monkeypatch.setattr(engine.tokenizer, "encode", record("encode"))
    monkeypatch.setattr(engine.tokenizer, "encode_without_gil", record("encode_without_gil"))
    for text in ("short", "y" * 60_000):
        response = await client.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 2}})
        assert response.status == 200, await response.text()
    assert threads == [("encode", True), ("encode_without_gil", False)]
