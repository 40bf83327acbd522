"""POST /tokenize and /detokenize (vLLM's shape): what the server would feed the model, and back.

A chat request is rendered exactly as /v1/chat/completions renders it, so a client can count its
prompt tokens before sending it.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from dsv4.server import validation as v
from dsv4.server.chat_prompt import build_chat_prompt
from dsv4.server.errors import bad_request
from dsv4.server.ops import json_response
from dsv4.server.state import ARGS, ENGINE


class TokenizeBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Either a `prompt`, or chat `messages` with the chat route's rendering fields."""

    model: str | None = None
    prompt: str | None = None
    messages: list[v.ChatMessage] | None = None
    tools: list[msgspec.Raw] | None = None
    tool_choice: str | v.NamedToolChoice | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict | None = None


class DetokenizeBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[v.Count]


async def tokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body: TokenizeBody = await v.decode_body(request, TokenizeBody, request.app[ARGS])
    v.check_model(body.model, engine.model_name)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", param="prompt")
    if body.messages is None:
        text, param = body.prompt, "prompt"
    else:
        chat = v.ChatCompletionBody(messages=body.messages, tools=body.tools, tool_choice=body.tool_choice,
                                    reasoning_effort=body.reasoning_effort,
                                    chat_template_kwargs=body.chat_template_kwargs)
        text, param = build_chat_prompt(chat).text, "messages"
    tokens = await v.tokenize(engine.tokenizer, text, engine.max_context, param) if text else []
    return json_response({"count": len(tokens), "max_model_len": engine.max_context, "tokens": tokens})


async def detokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body: DetokenizeBody = await v.decode_body(request, DetokenizeBody, request.app[ARGS])
    v.check_model(body.model, engine.model_name)
    vocab = engine.model_config.vocab_size
    for i, token in enumerate(body.tokens):
        if not 0 <= token < vocab:
            raise bad_request(f"token id {token} at index {i} is outside the vocabulary [0, {vocab})",
                              param="tokens", code="invalid_token_id")
    return json_response({"prompt": engine.tokenizer.decode(body.tokens)})
