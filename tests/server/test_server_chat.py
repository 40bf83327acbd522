"""Chat completions over the fake engine: prompt rendering, the parser's deltas, finish reasons."""

from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine
from sse_reader import parse_sse

from dsv4 import chat

D = chat.DSML
USER = [{"role": "user", "content": "Weather in Oslo?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = (f'\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="city" string="true">Oslo</{D}parameter>\n'
        f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
        f'</{D}invoke>\n</{D}tool_calls>{chat.EOS}')


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(max_context=8192)  # one token per character: tool prompts are long


def prompt_of(engine) -> str:
    return engine.tokenizer.decode(engine.submitted[-1].input_ids)


async def chat_stream(client, body: dict) -> list:
    response = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert response.status == 200, await response.text()
    return parse_sse(await response.read())


def reassemble(events: list) -> dict:
    """What an OpenAI client does with the deltas."""
    out = {"role": None, "content": "", "reasoning_content": "", "calls": {}, "finish_reason": None}
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            out["role"] = out["role"] or delta.get("role")
            out["content"] += delta.get("content") or ""
            out["reasoning_content"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or ():
                slot = out["calls"].setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
                slot["id"] = call.get("id") or slot["id"]
                slot["name"] += call.get("function", {}).get("name") or ""
                slot["arguments"] += call.get("function", {}).get("arguments") or ""
            out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


async def test_plain_reply_stream_and_whole(client, engine):
    reply = f"Hi there!{chat.EOS}"
    engine.reply_for = lambda request: reply
    events = await chat_stream(client, {"messages": USER, "stream_options": {"include_usage": True}})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    got = reassemble(events)
    assert (got["content"], got["finish_reason"], got["calls"]) == ("Hi there!", "stop", {})
    prompt_tokens = len(engine.submitted[-1].input_ids)
    assert events[-1]["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": len(reply),
                                   "total_tokens": prompt_tokens + len(reply),
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    assert prompt_of(engine) == chat.encode_messages(USER)

    whole = await (await client.post("/v1/chat/completions", json={"messages": USER})).json()
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Hi there!"}
    assert whole["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("fields,thinking,effort", [
    ({}, False, None),
    ({"chat_template_kwargs": {"thinking": True}}, True, None),
    ({"reasoning_effort": "max"}, True, "max"),
    ({"reasoning_effort": "low"}, False, None),
    ({"reasoning_effort": "high", "chat_template_kwargs": {"thinking": False}}, False, "high"),
])
async def test_thinking_mode_selection(client, engine, fields, thinking, effort):
    engine.reply_for = lambda request: f"Let me see.</think>Sunny.{chat.EOS}" if thinking else f"Sunny.{chat.EOS}"
    whole = await (await client.post("/v1/chat/completions", json={"messages": USER, **fields})).json()
    assert prompt_of(engine) == chat.encode_messages(USER, thinking=thinking, reasoning_effort=effort)
    message = whole["choices"][0]["message"]
    assert message["content"] == "Sunny."
    assert message.get("reasoning_content") == ("Let me see." if thinking else None)


async def test_tool_call_stream_reassembles(client, engine):
    engine.reply_for = lambda request: "Checking." + CALL
    events = await chat_stream(client, {"messages": USER, "tools": [WEATHER, TIME]})
    got = reassemble(events)
    assert got["content"] == "Checking." and got["finish_reason"] == "tool_calls"
    (call,) = got["calls"].values()
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert json.loads(call["arguments"]) == {"city": "Oslo", "days": 3}
    assert D not in json.dumps(events)  # no markup leaks anywhere
    assert prompt_of(engine) == chat.encode_messages(USER, tools=[WEATHER, TIME])

    whole = await (await client.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER]})).json()
    message = whole["choices"][0]["message"]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    assert message["content"] == "Checking."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "days": 3}


async def test_truncated_tool_call_finishes_with_length(client, engine):
    engine.reply_for = lambda request: CALL
    cut = CALL.index("Oslo") + 2
    events = await chat_stream(client, {"messages": USER, "tools": [WEATHER], "max_tokens": cut})
    assert reassemble(events)["finish_reason"] == "length"
    whole = await (await client.post("/v1/chat/completions",
                                      json={"messages": USER, "tools": [WEATHER], "max_tokens": cut})).json()
    assert whole["choices"][0]["finish_reason"] == "length"
    assert "tool_calls" not in whole["choices"][0]["message"]


@pytest.mark.parametrize("reply", [
    CALL.replace("get_weather", "launch_rockets"),  # a tool the request did not offer
    CALL.replace(f"</{D}invoke>", "</oops>"),  # malformed DSML
])
async def test_rejected_model_output_is_an_error_not_content(client, engine, reply):
    engine.reply_for = lambda request: reply
    events = await chat_stream(client, {"messages": USER, "tools": [WEATHER]})
    assert events[-1]["error"]["code"] == "invalid_model_output"
    assert D not in reassemble(events[:-1])["content"]
    response = await client.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER]})
    assert response.status == 500
    assert (await response.json())["error"]["code"] == "invalid_model_output"
    metrics = await (await client.get("/metrics")).text()
    assert "dsv4_chat_parse_errors_total 2.0" in metrics  # the streamed reply and the whole one


async def test_tool_choice_none_hides_tools_and_rejects_calls(client, engine):
    engine.reply_for = lambda request: CALL
    response = await client.post("/v1/chat/completions",
                                 json={"messages": USER, "tools": [WEATHER], "tool_choice": "none"})
    assert prompt_of(engine) == chat.encode_messages(USER)
    assert response.status == 500  # a call nobody offered is not passed through as text


async def test_named_tool_choice_shows_one_tool_and_starts_the_call(client, engine):
    # In chat mode the prompt already opens the named call, so the model continues its arguments.
    engine.reply_for = lambda request: CALL[CALL.index(f"<{D}parameter"):]
    body = {"messages": USER, "tools": [TIME, WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    events = await chat_stream(client, body)
    forced = f'\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
    assert prompt_of(engine) == chat.encode_messages(USER, tools=[WEATHER]) + forced
    got = reassemble(events)
    assert got["finish_reason"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()] == [
        ("get_weather", {"city": "Oslo", "days": 3})]


async def test_required_tool_choice_in_thinking_mode_is_not_forced(client, engine):
    engine.reply_for = lambda request: "Need weather.</think>" + CALL
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": "required",
            "chat_template_kwargs": {"thinking": True}}
    got = reassemble(await chat_stream(client, body))
    assert prompt_of(engine) == chat.encode_messages(USER, tools=[WEATHER], thinking=True)
    assert got["reasoning_content"] == "Need weather." and got["finish_reason"] == "tool_calls"


async def test_response_format_reaches_the_system_prompt(client, engine):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
    engine.reply_for = lambda request: '{"ok": true}' + chat.EOS
    await client.post("/v1/chat/completions", json={"messages": USER, "response_format": fmt})
    expected = chat.encode_messages([{"role": "system", "content": "", "response_format": fmt}, *USER])
    assert prompt_of(engine) == expected


async def test_tool_schema_key_order_is_kept(client, engine):
    reordered = {"type": "function", "function": {"parameters": {"b": 1, "a": 2}, "name": "f", "description": "d"}}
    await client.post("/v1/chat/completions", json={"messages": USER, "tools": [reordered]})
    assert '{"parameters": {"b": 1, "a": 2}, "name": "f", "description": "d"}' in prompt_of(engine)


def test_stray_think_markers_are_hidden_by_id():
    from dsv4.server.chat_completions import stray_think_markers

    class Ids:
        think_start_id, think_end_id = 4, 5

    assert stray_think_markers(Ids, thinking=True) == (4,)
    assert stray_think_markers(Ids, thinking=False) == (4, 5)
