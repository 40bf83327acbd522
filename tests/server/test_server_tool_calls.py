"""Tool calls through the real tokenizer, detokeniser, chat parser and SSE, for 64 concurrent
requests, with the sampler replaced by a per-request script.

The server is built in-process with `build_app` over a real Engine on the tiny checkpoint (real
scheduler, pages, tick loop, text streams). Two things are swapped: `dsv4.engine.tick.sample`
returns each request's scripted next token, found by the request's seed (unique per request, so
a token delivered to the wrong request shows up in that request's result); and the runner's
forward returns zero logits of the right shape, because the sampled tokens ignore them and the
real CPU forward of 64 tool prompts (~600 tokens each) takes minutes on two cores.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import torch
from aiohttp.test_utils import TestServer

import dsv4.engine.tick
from dsv4 import chat
from dsv4.config import ServerArgs
from dsv4.engine.engine import Engine
from dsv4.server.app import build_app

pytestmark = pytest.mark.timeout(300)

D = chat.DSML
REQUESTS = 64
SEED_BASE = 5000


def tools_for(i: int) -> list[dict]:
    own = {"type": "function", "function": {
        "name": f"lookup_{i}", "description": f"Look up record {i}",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}}},
    }}
    weather = {"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }}
    return [own, weather] if i % 3 else [own]


def invoke(name: str, args: dict) -> str:
    params = "\n".join(
        f'<{D}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
        f'{v if isinstance(v, str) else json.dumps(v)}</{D}parameter>'
        for k, v in args.items()
    )
    return f'<{D}invoke name="{name}">\n{params}\n</{D}invoke>'


def expected_for(i: int) -> dict:
    thinking = i % 2 == 1
    calls = [(f"lookup_{i}", {"city": f"Town {i} 日本", "n": i})]
    if i % 3:
        calls.append(("get_weather", {"city": f"Oslo-{i}"}))
    return {
        "thinking": thinking,
        "reasoning": f"Request {i} needs data." if thinking else "",
        "content": f"Looking up {i}." if i % 4 < 2 else "",
        "calls": calls,
    }


def completion_text(expected: dict) -> str:
    block = "\n".join(invoke(name, args) for name, args in expected["calls"])
    reasoning = expected["reasoning"] + "</think>" if expected["thinking"] else ""
    return f"{reasoning}{expected['content']}\n\n<{D}tool_calls>\n{block}\n</{D}tool_calls>"


@pytest.fixture
async def scripted_server(tiny_ckpt, monkeypatch):
    args = ServerArgs(model=str(tiny_ckpt), dtype="float32", max_running_requests=REQUESTS,
                      chunked_prefill_size=4096)
    engine = Engine.from_args(args)
    eos = engine.model_config.eos_token_id
    scripts = {SEED_BASE + i: engine.tokenizer.encode(completion_text(expected_for(i))) + [eos]
               for i in range(REQUESTS)}
    progress = dict.fromkeys(scripts, 0)

    def scripted_sample(logits, params, *positions_and_histories):
        tokens = []
        for p in params:
            step = progress[p.seed]
            progress[p.seed] += 1
            tokens.append(scripts[p.seed][step] if step < len(scripts[p.seed]) else eos)
        return tokens

    def zero_logits(batch):
        return torch.zeros(sum(chunk.sample for chunk in batch.chunks), engine.model_config.vocab_size)

    monkeypatch.setattr(dsv4.engine.tick, "sample", scripted_sample)
    monkeypatch.setattr(engine.runner, "forward", zero_logits)
    await engine.start()
    server = TestServer(build_app(engine, args))
    await server.start_server()
    try:
        yield server, engine
    finally:
        await server.close()
        await engine.stop()


async def run_request(client: openai.AsyncOpenAI, model: str, i: int) -> dict:
    expected = expected_for(i)
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Please look up {i}."}], tools=tools_for(i),
        temperature=0.7, seed=SEED_BASE + i, stream=True,
        extra_body={"chat_template_kwargs": {"thinking": expected["thinking"]}},
    )
    got = {"reasoning": "", "content": "", "calls": {}, "finish_reason": None}
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            got["content"] += delta.content or ""
            got["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or ():
                slot = got["calls"].setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = call.id or slot["id"]
                if call.function is not None:
                    slot["name"] += call.function.name or ""
                    slot["arguments"] += call.function.arguments or ""
            got["finish_reason"] = choice.finish_reason or got["finish_reason"]
    return got


async def test_concurrent_tool_calls_do_not_mix(scripted_server):
    server, engine = scripted_server
    client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0, timeout=240)
    results = await asyncio.wait_for(
        asyncio.gather(*(run_request(client, engine.model_name, i) for i in range(REQUESTS))), timeout=280
    )
    for i, got in enumerate(results):
        expected = expected_for(i)
        assert got["finish_reason"] == "tool_calls", (i, got)
        assert got["reasoning"] == expected["reasoning"], i
        assert got["content"] == expected["content"], i
        calls = [got["calls"][k] for k in sorted(got["calls"])]
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == expected["calls"], i
        assert len({c["id"] for c in calls}) == len(calls)
    state = engine.debug_requests()
    assert not state["requests"] and state["free_slots"] == state["total_slots"]
