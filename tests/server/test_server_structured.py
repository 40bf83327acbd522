"""Structured outputs against a real `python -m dsv4 serve` on the random tiny checkpoint: whatever the
random model prefers, the grammar makes every reply parse and validate.

Every schema here bounds its output (maxLength, maxItems, integer ranges, enums, no additional
properties), so the grammar itself brings each reply to its end within max_tokens: each reply must
finish with "stop", never "length" mid-JSON.
"""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import jsonschema
import pytest
from live_server import LiveServer, live_servers
from sse_reader import parse_sse

from dsv4.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(600)

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Reply."}]
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("structured") / "server.log"
    with live_servers(LiveServer(tiny_ckpt, log, "--max-running-requests", "64")) as (live,):
        yield live.base


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt) -> Tokenizer:
    return Tokenizer.from_dir(tiny_ckpt)


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=300)) as response:
        payload = await response.json()
        assert response.status == 200, payload
        return payload


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema mixing the keywords structured outputs are used with, every part bounded."""
    kinds = ["string", "integer", "boolean", "enum", "number", "array"] + (["object"] if depth < 2 else [])
    properties = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(kinds)
        if kind == "string":
            prop = {"type": "string", "maxLength": rng.randint(0, 8)}
            if rng.random() < 0.3:
                prop["minLength"] = min(2, prop["maxLength"])
        elif kind == "integer":
            low = rng.randint(-50, 50)
            prop = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
        elif kind == "number":
            prop = {"type": "number", "minimum": -1.5, "maximum": rng.choice([2.5, 100])}
        elif kind == "boolean":
            prop = {"type": "boolean"}
        elif kind == "enum":
            prop = {"enum": rng.sample(["red", "green", "blue", "dark grey", "零", "x\"y"], rng.randint(1, 4))}
        elif kind == "array":
            prop = {"type": "array", "items": rng.choice([{"type": "boolean"}, {"type": "integer", "minimum": 0,
                                                                                  "maximum": 9}]),
                    "maxItems": rng.randint(1, 4)}
        else:
            prop = random_schema(rng, depth + 1)
        properties[f"{kind}_{i}"] = prop
    names = list(properties)
    required = names if rng.random() < 0.5 else rng.sample(names, rng.randint(0, len(names)))
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def schema_request(schema: dict, seed: int) -> dict:
    return {"messages": USER, "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": f"s{seed}", "schema": schema,
                                                                        "strict": True}}}


async def test_fifty_json_schemas_all_parse_and_validate(server):
    rng = random.Random(14)
    distinct: dict[str, dict] = {}
    while len(distinct) < 50:
        schema = random_schema(rng)
        distinct.setdefault(json.dumps(schema, sort_keys=True), schema)
    schemas = list(distinct.values())
    async with aiohttp.ClientSession() as session:
        replies = await asyncio.gather(*(post(session, server + CHAT, schema_request(schema, i))
                                         for i, schema in enumerate(schemas)))
    for schema, reply in zip(schemas, replies, strict=True):
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "stop", (schema, choice)
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


async def test_json_object_is_an_object(server, tokenizer):
    # The random model, left alone, never closes a string: a bias towards '"' and '}' lets it end the
    # reply, and the grammar makes whatever it writes an object.
    bias = {str(tokenizer.encode(text)[0]): 8 for text in ('"', "}")}
    async with aiohttp.ClientSession() as session:
        for seed in range(3):
            reply = await post(session, server + CHAT, {
                "messages": USER, "max_tokens": 100, "temperature": 0.7, "seed": seed, "logit_bias": bias,
                "response_format": {"type": "json_object"}})
            choice = reply["choices"][0]
            assert choice["finish_reason"] == "stop", choice
            assert isinstance(json.loads(choice["message"]["content"]), dict), choice


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string", "maxLength": 8},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "book_table", "parameters": {
        "type": "object", "properties": {
            "party": {"type": "object", "properties": {
                "size": {"type": "integer", "minimum": 1, "maximum": 12},
                "names": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3}},
                "required": ["size", "names"], "additionalProperties": False},
            "outdoor": {"type": "boolean"}},
        "required": ["party"]}}},
    {"type": "function", "function": {"name": "ping"}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"].get("parameters") or {"type": "object", "properties": {},
                                                                               "additionalProperties": False}
           for tool in TOOLS}


def assert_valid_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    for call in calls:
        name = call["function"]["name"]
        assert name in names, call
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


async def streamed_calls(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[list[dict], str]:
    async with session.post(url, json={**body, "stream": True}, timeout=aiohttp.ClientTimeout(total=300)) as response:
        assert response.status == 200
        events = parse_sse(await response.read())
    calls: dict[int, dict] = {}
    finish = None
    for event in events:
        assert "error" not in event, event
        for choice in event["choices"]:
            for delta in choice["delta"].get("tool_calls") or ():
                call = calls.setdefault(delta["index"], {"function": {"name": "", "arguments": ""}})
                call["function"]["name"] += delta.get("function", {}).get("name") or ""
                call["function"]["arguments"] += delta.get("function", {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("thinking", [False, True])
async def test_required_tool_choice_always_calls_a_tool_with_valid_arguments(server, tokenizer, thinking):
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": MAX_TOKENS,
            "temperature": 0.8, "chat_template_kwargs": {"thinking": thinking}}
    if thinking:  # the random model would reason until max_tokens: a bias on </think> ends its reasoning
        body["logit_bias"] = {str(tokenizer.think_end_id): 12}
    names = {tool["function"]["name"] for tool in TOOLS}
    async with aiohttp.ClientSession() as session:
        replies = await asyncio.gather(*(post(session, server + CHAT, {**body, "seed": seed}) for seed in range(12)))
        streamed = await asyncio.gather(*(streamed_calls(session, server + CHAT, {**body, "seed": seed})
                                          for seed in range(12)))
    for reply, (calls, finish) in zip(replies, streamed, strict=True):
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert_valid_calls(choice["message"]["tool_calls"], names)
        assert finish == "tool_calls"
        # Streaming and not, the same seed gives the same calls.
        assert [c["function"] for c in calls] == [c["function"] for c in choice["message"]["tool_calls"]]


async def test_named_tool_choice_calls_that_function(server):
    async with aiohttp.ClientSession() as session:
        for name in ("book_table", "ping"):
            for seed in range(4):
                reply = await post(session, server + CHAT, {
                    "messages": USER, "tools": TOOLS, "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": seed,
                    "tool_choice": {"type": "function", "function": {"name": name}}})
                choice = reply["choices"][0]
                assert choice["finish_reason"] == "tool_calls", choice
                assert_valid_calls(choice["message"]["tool_calls"], {name})


async def test_an_unconstrained_request_is_untouched_by_constrained_neighbours(server):
    plain = {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        alone = await post(session, server + "/v1/completions", plain)
        schema = random_schema(random.Random(5))
        together = await asyncio.gather(
            *(post(session, server + CHAT, schema_request(schema, seed)) for seed in range(6)),
            post(session, server + "/v1/completions", plain),
            *(post(session, server + "/v1/completions", {**plain, "temperature": 0.8, "seed": seed,
                                                         "response_format": {"type": "json_object"}})
              for seed in range(6)))
    assert together[6]["choices"][0]["text"] == alone["choices"][0]["text"]
    for reply in together[:6]:
        jsonschema.validate(json.loads(reply["choices"][0]["message"]["content"]), schema)


async def test_native_regex_and_json_schema(server):
    async with aiohttp.ClientSession() as session:
        by_regex = await post(session, server + "/generate", {"text": "Hello", "sampling_params": {
            "regex": "(yes|no), [0-9]{2}", "max_new_tokens": 32, "temperature": 0.8, "seed": 3}})
        schema = {"type": "array", "items": {"enum": [1, "two", None]}, "minItems": 1, "maxItems": 3}
        by_schema = await post(session, server + "/generate", {"text": "Hello", "sampling_params": {
            "json_schema": json.dumps(schema), "max_new_tokens": 32, "temperature": 0.8, "seed": 3}})
    assert by_regex["meta_info"]["finish_reason"] == "stop"
    head, number = by_regex["text"].split(", ")
    assert head in ("yes", "no") and len(number) == 2 and number.isdigit()
    assert by_schema["meta_info"]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(by_schema["text"]), schema)
