"""/tokenize and /detokenize: the ids the generation routes would feed the engine, and back."""

from __future__ import annotations

import pytest

HELLO = [{"role": "user", "content": "hi"}]


async def test_tokenize_a_prompt_and_back(client, engine):
    response = await client.post("/tokenize", json={"prompt": "héllo"})
    assert response.status == 200
    body = await response.json()
    assert body == {"count": 5, "max_model_len": engine.max_context, "tokens": [ord(c) for c in "héllo"]}
    back = await client.post("/detokenize", json={"tokens": body["tokens"]})
    assert (await back.json()) == {"prompt": "héllo"}


async def test_tokenized_messages_are_what_the_chat_route_feeds_the_engine(client, engine):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    engine.max_context = 4096
    for extra in ({}, {"tools": tools}, {"chat_template_kwargs": {"thinking": True}}):
        counted = await (await client.post("/tokenize", json={"messages": HELLO, **extra})).json()
        await client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2, **extra})
        assert counted["tokens"] == list(engine.submitted[-1].input_ids)


@pytest.mark.parametrize("route,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": HELLO}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [2**40]}, "tokens[0]"),
    ("/detokenize", {}, "tokens"),
])
async def test_bad_bodies_are_400_naming_the_field(client, route, body, param):
    response = await client.post(route, json=body)
    assert response.status == 400
    assert (await response.json())["error"]["param"] == param
