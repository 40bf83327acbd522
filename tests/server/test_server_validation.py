"""Bad input gets a 4xx JSON error naming the field, and the server stays up."""

from __future__ import annotations

import sys

import pytest

from dsv4.server.validation import MAX_JSON_NESTING

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
HELLO = [{"role": "user", "content": "hi"}]
TOO_LONG = "x" * 300  # the fake engine's context is 256 tokens of one character each
TOOL_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
DEEP = "[" * 1000 + "]" * 1000

BAD_BODIES = [
    # (route, body, status, param, code)
    (CHAT, {"messages": HELLO, "max_tokens": "ten"}, 400, "max_tokens", "invalid_type"),
    (CHAT, {"messages": HELLO, "max_tokens": -1}, 400, "max_tokens", None),
    (CHAT, {"messages": HELLO, "max_tokens": 0}, 400, "max_tokens", None),
    (CHAT, {"messages": HELLO, "max_tokens": 10**9}, 400, "max_tokens", "context_length_exceeded"),
    (CHAT, {"messages": HELLO, "max_completion_tokens": 10**9}, 400, "max_completion_tokens",
     "context_length_exceeded"),
    (CHAT, {"messages": [{"role": "user", "content": TOO_LONG}]}, 400, "messages", "context_length_exceeded"),
    (CHAT, {"messages": []}, 400, "messages", None),
    (CHAT, {"model": "gpt-5", "messages": HELLO}, 404, "model", "model_not_found"),
    (CHAT, {"model": 7, "messages": HELLO}, 400, "model", "invalid_type"),
    (CHAT, {}, 400, "messages", "invalid_type"),
    (CHAT, {"messages": [{"content": "no role"}]}, 400, "messages[0].role", "invalid_type"),
    (CHAT, {"messages": [{"role": 3, "content": "x"}]}, 400, "messages[0].role", "invalid_type"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", None),
    (CHAT, {"messages": HELLO, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    (CHAT, {"messages": HELLO, "temperature": 7}, 400, "temperature", None),
    (CHAT, {"messages": HELLO, "top_p": 0}, 400, "top_p", None),
    (CHAT, {"messages": HELLO, "top_k": -5}, 400, "top_k", None),
    (CHAT, {"messages": HELLO, "stream": "yes"}, 400, "stream", "invalid_type"),
    (CHAT, {"messages": HELLO, "stop": ["ok", ""]}, 400, "stop", None),
    (CHAT, {"messages": HELLO, "stop": 5}, 400, "stop", "invalid_type"),
    (CHAT, {"messages": HELLO, "n": 0}, 400, "n", None),
    (COMPLETIONS, {"prompt": "hi", "n": 65}, 400, "n", None),
    (COMPLETIONS, {"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    (CHAT, {"messages": HELLO, "top_logprobs": 2}, 400, "top_logprobs", None),
    (CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "invalid_value"),
    (CHAT, {"messages": HELLO, "seed": "s"}, 400, "seed", "invalid_type"),
    (CHAT, {"messages": HELLO, "stream_options": {"include_usage": 1}}, 400, "stream_options.include_usage",
     "invalid_type"),
    (CHAT, {"messages": HELLO, "tool_choice": "required"}, 400, "tool_choice", None),
    (CHAT, {"messages": HELLO, "tool_choice": "sometimes",
            "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice", None),
    (CHAT, {"messages": HELLO, "tool_choice": {"type": "function", "function": {"name": "g"}},
            "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice", None),
    (CHAT, {"messages": HELLO, "tools": [{"type": "function", "function": {"description": "no name"}}]}, 400,
     "tools[0].function.name", "invalid_type"),
    (CHAT, {"messages": HELLO, "response_format": {"type": "xml"}}, 400, "response_format.type", None),
    (CHAT, {"messages": HELLO, "reasoning_effort": "extreme"}, 400, "reasoning_effort", None),
    (CHAT, {"messages": HELLO, "chat_template_kwargs": {"thinking": "yes"}}, 400,
     "chat_template_kwargs.thinking", None),
    (COMPLETIONS, {"prompt": TOO_LONG}, 400, "prompt", "context_length_exceeded"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt", None),
    (COMPLETIONS, {"prompt": ["a", "b"]}, 400, "prompt", "unsupported_parameter"),
    (COMPLETIONS, {"prompt": [1, -2]}, 400, "prompt", "invalid_token_id"),
    (COMPLETIONS, {"prompt": {"text": "x"}}, 400, "prompt", "invalid_type"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 255}, 400, "max_tokens", "context_length_exceeded"),
    (COMPLETIONS, {"prompt": "hi", "suffix": "x"}, 400, "suffix", "unsupported_parameter"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    (COMPLETIONS, {"prompt": "hi", "model": "other"}, 404, "model", "model_not_found"),
    (GENERATE, {"text": "hi", "input_ids": [1]}, 400, "input_ids", None),
    (GENERATE, {"text": "hi", "return_logprob": True, "logprob_start_len": -2}, 400, "logprob_start_len", None),
    (GENERATE, {"text": "hi", "return_logprob": True, "top_logprobs_num": 30}, 400, "top_logprobs_num",
     "invalid_value"),
    (GENERATE, {}, 400, "input_ids", None),
    (GENERATE, {"input_ids": [5, 0x110000]}, 400, "input_ids", "invalid_token_id"),
    (GENERATE, {"input_ids": "1 2 3"}, 400, "input_ids", "invalid_type"),
    (GENERATE, {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, 400, "sampling_params.max_new_tokens",
     None),
    (GENERATE, {"text": "hi", "sampling_params": {"temperature": -1}}, 400, "sampling_params.temperature", None),
    (GENERATE, {"text": "hi", "sampling_params": {"top_k": "all"}}, 400, "sampling_params.top_k", "invalid_type"),
    (GENERATE, {"text": "hi", "sampling_params": {"stop_token_ids": [-3]}}, 400,
     "sampling_params.stop_token_ids", None),
    # Numbers at and past the edges of their ranges never reach the engine (a seed past 64 bits
    # used to kill the tick loop).
    *[(CHAT, {"messages": HELLO, "temperature": 0.5, "seed": seed}, 400, "seed", "invalid_value")
      for seed in (2**64, 18446744073709551616 * 7, 2**63, -(2**63) - 1)],
    (COMPLETIONS, {"prompt": "hi", "seed": 2**64}, 400, "seed", "invalid_value"),
    (GENERATE, {"text": "hi", "sampling_params": {"seed": 2**64}}, 400, "sampling_params.seed", "invalid_value"),
    (GENERATE, {"text": "hi", "sampling_params": {"top_k": 2**64}}, 400, "sampling_params.top_k", "invalid_value"),
    (CHAT, {"messages": HELLO, "top_k": 2**40}, 400, "top_k", "invalid_value"),
    (CHAT, {"messages": HELLO, "max_tokens": 2**70}, 400, "max_tokens", "invalid_value"),
    (CHAT, {"messages": HELLO, "n": 2**64}, 400, "n", "invalid_value"),
    (CHAT, {"messages": HELLO, "top_p": 1.5}, 400, "top_p", "invalid_value"),
    (CHAT, {"messages": HELLO, "stop": ["s"] * 17}, 400, "stop", "invalid_value"),
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [2**65]}, 400, "stop_token_ids[0]", "invalid_value"),
    (COMPLETIONS, {"prompt": "hi", "best_of": -(2**64)}, 400, "best_of", "invalid_value"),
    # Logits processors: their documented ranges, and logit_bias keys that name token ids.
    (CHAT, {"messages": HELLO, "presence_penalty": 2.5}, 400, "presence_penalty", "invalid_value"),
    (CHAT, {"messages": HELLO, "frequency_penalty": -3}, 400, "frequency_penalty", "invalid_value"),
    (CHAT, {"messages": HELLO, "repetition_penalty": 0}, 400, "repetition_penalty", "invalid_value"),
    (COMPLETIONS, {"prompt": "hi", "min_p": 1.5}, 400, "min_p", "invalid_value"),
    (CHAT, {"messages": HELLO, "logit_bias": {"5": 101}}, 400, "logit_bias[...]", "invalid_value"),
    *[(CHAT, {"messages": HELLO, "logit_bias": {key: 1}}, 400, "logit_bias", None)
      for key in ("x", "-1", "1.5", "99999999", "٣")],
    (GENERATE, {"text": "hi", "sampling_params": {"repetition_penalty": 3}}, 400,
     "sampling_params.repetition_penalty", "invalid_value"),
    (GENERATE, {"text": "hi", "sampling_params": {"logit_bias": {"z": 1}}}, 400, "sampling_params.logit_bias", None),
    *[(CHAT, {"messages": HELLO, "tools": [{"type": "function", "function": {"name": name}}]}, 400,
       "tools[0].function.name", None) for name in ("", "get weather", 'f"x', "a\nb", "x" * 65, "名前")],
    # A field dsv4 does not implement is refused, named, never silently dropped.
    (CHAT, {"messages": HELLO, "best_of": 2}, 400, "best_of", "unknown_parameter"),
    (CHAT, {"messages": HELLO, "modalities": ["audio"]}, 400, "modalities", "unknown_parameter"),
    (CHAT, {"messages": HELLO, "min_tokens": 3}, 400, "min_tokens", "unknown_parameter"),
    (COMPLETIONS, {"prompt": "hi", "functions": []}, 400, "functions", "unknown_parameter"),
    (GENERATE, {"text": "hi", "return_hidden_states": True}, 400, "return_hidden_states", "unknown_parameter"),
    (GENERATE, {"text": "hi", "sampling_params": {"ebnf": "root ::= x"}}, 400, "sampling_params.ebnf",
     "unknown_parameter"),
    # A schema or pattern that cannot constrain the output is named before anything runs.
    (CHAT, {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, 400,
     "response_format.json_schema.schema", "invalid_schema"),
    (CHAT, {"messages": HELLO, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "g", "parameters": {
            "type": "object", "properties": {"p": {"type": "string", "pattern": "("}}}}}]}, 400,
     "tools[1].function.parameters", "invalid_schema"),
    (COMPLETIONS, {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "integer", "minimum": "zero"}}}}, 400, "response_format.json_schema.schema",
     "invalid_schema"),
    (GENERATE, {"text": "hi", "sampling_params": {"json_schema": "[1, 2"}}, 400, "sampling_params.json_schema", None),
    (GENERATE, {"text": "hi", "sampling_params": {"regex": "(ab"}}, 400, "sampling_params.regex", "invalid_schema"),
    # Chat structure: a tool result answers a call made just before it; call arguments are JSON.
    (CHAT, {"messages": [*HELLO, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}, 400,
     "messages[1].role", None),
    (CHAT, {"messages": [*HELLO, TOOL_CALL, {"role": "tool", "content": "sunny"}]}, 400,
     "messages[2].tool_call_id", None),
    (CHAT, {"messages": [*HELLO, TOOL_CALL, {"role": "tool", "tool_call_id": "c9", "content": "sunny"}]}, 400,
     "messages[2].tool_call_id", None),
    (CHAT, {"messages": [*HELLO, TOOL_CALL, {"role": "user", "content": "and?"},
                         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}, 400, "messages[3].role", None),
    *[(CHAT, {"messages": [*HELLO, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}]}, 400,
       "messages[1].tool_calls[0].function.arguments", None)
      for arguments in ("{city: Paris}", "[1, 2]", '"Paris"', "")],
]


async def assert_error(response, status: int, param: str | None, code: str | None = None) -> dict:
    assert response.status == status, await response.text()
    assert response.content_type == "application/json"
    error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


async def assert_alive(client) -> None:
    response = await client.get("/health")
    assert response.status == 200


@pytest.mark.parametrize("route,body,status,param,code", BAD_BODIES)
async def test_bad_body_names_the_field(client, engine, route, body, status, param, code):
    error = await assert_error(await client.post(route, json=body), status, param, code)
    assert error["type"] == "invalid_request_error"
    assert not engine.submitted  # nothing reached the engine
    await assert_alive(client)


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS, GENERATE])
@pytest.mark.parametrize(
    "raw,code",
    [(b"{not json", "invalid_json"), (b"", "invalid_json"), (b'{"prompt": "\xff\xfe"}', "invalid_utf8"),
     (b"[1, 2]", "invalid_type")],
)
async def test_undecodable_body(client, route, raw, code):
    response = await client.post(route, data=raw, headers={"Content-Type": "application/json"})
    await assert_error(response, 400, None, code)
    await assert_alive(client)


async def test_body_over_the_limit_is_413(client):
    huge = {"prompt": "x" * (64 * 1024)}
    await assert_error(await client.post(COMPLETIONS, json=huge), 413, None, "request_too_large")
    # Without a Content-Length the limit still holds, as aiohttp reads the chunked body.
    async def chunks():
        for _ in range(80):
            yield b"x" * 1024
    response = await client.post(COMPLETIONS, data=chunks(), headers={"Content-Type": "application/json"})
    await assert_error(response, 413, None)
    await assert_alive(client)


async def test_engine_refusal_is_400(client, engine):
    engine.refusal = "the prompt needs 9 pages; the pool has 8"
    for route, body, param in ((CHAT, {"messages": HELLO}, "messages"), (COMPLETIONS, {"prompt": "hi"}, "prompt"),
                               (GENERATE, {"text": "hi"}, "text")):
        for stream in (False, True):
            error = await assert_error(await client.post(route, json={**body, "stream": stream}), 400, param,
                                       "context_length_exceeded")
            assert "9 pages" in error["message"]
    await assert_alive(client)


async def test_unknown_route_and_wrong_method_are_json(client):
    await assert_error(await client.get("/v1/nothing"), 404, None, "not_found")
    response = await client.get(CHAT)
    await assert_error(response, 405, None, "method_not_allowed")
    assert "POST" in response.headers["Allow"]
    await assert_error(await client.post("/health"), 405, None, "method_not_allowed")


async def test_unexpected_exception_is_500_with_request_id(client, engine):
    def broken():
        raise RuntimeError("secret internals")

    engine.debug_requests = broken
    response = await client.get("/debug/requests")
    assert response.status == 500
    error = (await response.json())["error"]
    assert error["type"] == "server_error"
    assert "secret internals" not in error["message"] and "Traceback" not in error["message"]
    assert response.headers["X-Request-Id"] in error["message"]
    await assert_alive(client)


@pytest.mark.parametrize("route,raw,param,code", [
    (CHAT, ('{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
            '{"name": "f", "parameters": {"a": DEEP}}}]}'), None, "invalid_json"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "x": DEEP}]}]}', None, "invalid_json"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": DEEP}}', None,
     "invalid_json"),
    (COMPLETIONS, '{"prompt": "hi", "metadata": {"a": DEEP}}', None, "invalid_json"),
    (GENERATE, '{"text": "hi", "extra": DEEP}', None, "invalid_json"),
])
@pytest.mark.parametrize("recursion_limit", [1000, 20_000])
async def test_deep_nesting_is_400(client, engine, route, raw, param, code, recursion_limit):
    """Whatever the interpreter's recursion limit (libraries raise it: inductor's compile does)."""
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(recursion_limit)
    try:
        raw = raw.replace("DEEP", DEEP)
        response = await client.post(route, data=raw.encode(), headers={"Content-Type": "application/json"})
        await assert_error(response, 400, param, code)
    finally:
        sys.setrecursionlimit(previous)
    assert not engine.submitted
    await assert_alive(client)


async def test_nesting_within_the_limit_is_served(client):
    nested = "[" * (MAX_JSON_NESTING - 2) + "]" * (MAX_JSON_NESTING - 2)  # with the body's own two: the limit
    raw = '{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": NESTED}}'
    response = await client.post(CHAT, data=raw.replace("NESTED", nested).encode(),
                                  headers={"Content-Type": "application/json"})
    assert response.status == 200, await response.text()


async def test_numbers_beyond_float_range_are_400(client):
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}'
    response = await client.post(CHAT, data=raw, headers={"Content-Type": "application/json"})
    await assert_error(response, 400, "temperature", "invalid_value")


async def test_tool_turns_that_answer_their_calls_are_accepted(client, engine):
    engine.max_context = 1024
    messages = [*HELLO, TOOL_CALL, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    response = await client.post(CHAT, json={"messages": messages, "max_tokens": 5})
    assert response.status == 200, await response.text()
    assert engine.submitted


async def test_edge_of_range_values_are_accepted(client, engine):
    for seed in (2**63 - 1, -(2**63), 0):
        body = {"messages": HELLO, "max_tokens": 5, "temperature": 2, "seed": seed, "top_k": 2**31 - 1,
                "presence_penalty": 0, "repetition_penalty": 1, "logit_bias": {}}
        response = await client.post(CHAT, json=body)
        assert response.status == 200, await response.text()
    assert [r.sampling.seed for r in engine.submitted] == [2**63 - 1, -(2**63), 0]


@pytest.mark.parametrize("route,body", [(CHAT, {"messages": HELLO}), (COMPLETIONS, {"prompt": "hi"})])
async def test_fields_without_behaviour_are_accepted(client, route, body):
    body = {**body, "max_tokens": 3, "user": "u-1", "metadata": {"team": "evals"}, "store": False,
            "service_tier": "auto"}
    if route == CHAT:
        body["parallel_tool_calls"] = True
    response = await client.post(route, json=body)
    assert response.status == 200, await response.text()


@pytest.mark.parametrize("route,body,prefix", [
    (CHAT, {"messages": HELLO}, ""), (COMPLETIONS, {"prompt": "hi"}, ""), (GENERATE, {"text": "hi"}, "sampling_params")])
async def test_logits_processors_reach_the_engine(client, engine, route, body, prefix):
    fields = {"presence_penalty": 1.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "min_p": 0.05,
              "logit_bias": {"5": -100, "17": 2.5}}
    body = {**body, prefix: fields} if prefix else {**body, **fields}
    response = await client.post(route, json=body)
    assert response.status == 200, await response.text()
    sampling = engine.submitted[-1].sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty, sampling.min_p) == (
        1.5, -0.5, 1.2, 0.05)
    assert sampling.logit_bias == ((5, -100.0), (17, 2.5))


async def test_good_requests_still_work_after_bad_ones(client):
    for route, body, *_ in BAD_BODIES[:5]:
        await client.post(route, json=body)
    response = await client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 5})
    assert response.status == 200
    assert (await response.json())["choices"][0]["text"] == "Hello"
