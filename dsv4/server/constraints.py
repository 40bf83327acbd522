"""The grammar a request's output must follow, compiled and validated before admission: a schema
llguidance cannot use is a 400 naming the field that holds it.

Chat: `response_format` json_object / json_schema makes the reply one JSON value (after the
reasoning, in thinking mode); `tool_choice` "required" or a named function makes it a DSML tool-call
block whose calls name the tools shown and whose arguments follow each tool's parameter schema
(response_format then only reaches the prompt); with tool_choice "auto", tools shown and a
response_format, the reply is either such a block or the JSON value. Completions take
`response_format` for the whole text; /generate takes SGLang's `json_schema` and `regex`.
"""

from __future__ import annotations

import asyncio

import msgspec

from dsv4.chat import grammar as chat_grammar
from dsv4.engine import grammar
from dsv4.server import validation as v
from dsv4.server.chat_prompt import ChatPrompt
from dsv4.server.errors import bad_request

ANY_OBJECT = {"type": "object"}


async def chat_grammar_for(body: v.ChatCompletionBody, prompt: ChatPrompt, tokenizer) -> str | None:
    choice = body.tool_choice
    schema = await response_schema(body.response_format)
    forced_call = bool(prompt.tools) and (choice == "required" or isinstance(choice, v.NamedToolChoice))
    if not forced_call and schema is None:
        return None
    marker = grammar.marker_terms(tokenizer)
    if not forced_call and not prompt.tools:
        return await _checked(grammar.from_lark(chat_grammar.json_answer(schema, prompt.thinking, marker)),
                              "response_format")
    for i, raw in enumerate(body.tools or ()):
        parameters = msgspec.json.decode(raw).get("function", {}).get("parameters")
        if parameters is not None:
            await _checked(_json_schema_grammar(parameters, f"tools[{i}].function.parameters"),
                           f"tools[{i}].function.parameters")
    lark = chat_grammar.tool_calls(prompt.tools, prompt.thinking, marker, named=isinstance(choice, v.NamedToolChoice),
                                   forced_start=prompt.forced_start,
                                   alternative_schema=None if forced_call else schema)
    return await _checked(grammar.from_lark(lark), "tool_choice" if forced_call else "response_format")


async def response_schema(response_format) -> dict | None:
    """The schema a response_format asks the reply to follow (validated), or None for text."""
    if response_format is None or isinstance(response_format, msgspec.Raw) and bytes(response_format) in (b"", b"null"):
        return None
    parsed = response_format if isinstance(response_format, v.ResponseFormat) else v.decode_part(
        response_format, v.ResponseFormat, "response_format")
    if parsed.type == "text":
        return None
    if parsed.type == "json_object":
        return ANY_OBJECT
    if parsed.type != "json_schema":
        raise bad_request(f"response_format type {parsed.type!r} is not supported", param="response_format.type")
    if parsed.json_schema is None or parsed.json_schema.schema is None:
        raise bad_request("response_format json_schema needs a schema", param="response_format.json_schema")
    param = "response_format.json_schema.schema"
    await _checked(_json_schema_grammar(parsed.json_schema.schema, param), param)
    return parsed.json_schema.schema


async def completion_grammar(response_format: v.ResponseFormat | None) -> str | None:
    schema = await response_schema(response_format)
    return None if schema is None else _json_schema_grammar(schema, "response_format")


async def native_grammar(params: v.NativeSampling) -> str | None:
    if params.json_schema is not None and params.regex is not None:
        raise bad_request("give at most one of json_schema and regex", param="sampling_params.regex")
    if params.json_schema is not None:
        param = "sampling_params.json_schema"
        return await _checked(_json_schema_grammar(params.json_schema, param), param)
    if params.regex is not None:
        return await _checked(grammar.from_regex(params.regex), "sampling_params.regex")
    return None


def _json_schema_grammar(schema: dict | str, param: str) -> str:
    try:
        return grammar.from_json_schema(schema)
    except ValueError as e:  # not a JSON object
        raise bad_request(f"not a JSON schema: {e}", param=param) from None


async def _checked(compiled: str, param: str) -> str:
    # Off the event loop: a large schema takes a while to compile.
    error = await asyncio.to_thread(grammar.grammar_error, compiled)
    if error:
        raise bad_request(f"the schema cannot constrain the output: {error}", param=param, code="invalid_schema")
    return compiled
