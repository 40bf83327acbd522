"""POST /v1/completions: a prompt string or token ids in, text out (OpenAI's legacy API)."""

from __future__ import annotations

import time

from aiohttp import web

from dsv4.protocol import RequestOutput
from dsv4.server import validation as v
from dsv4.server.constraints import completion_grammar
from dsv4.server.errors import bad_request
from dsv4.server.ops import json_response
from dsv4.server.state import ARGS, ENGINE, REQUEST_ID
from dsv4.server.streaming import choices, collect, stream

DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for this endpoint


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


async def completions(request: web.Request) -> web.StreamResponse:
    engine, args = request.app[ENGINE], request.app[ARGS]
    body: v.CompletionBody = await v.decode_body(request, v.CompletionBody, args)
    v.check_model(body.model, engine.model_name)
    v.check_choices(body.n)
    _check_unsupported(body)
    input_ids = await _prompt_ids(body.prompt, engine)
    v.check_prompt_ids(input_ids, engine.model_config.vocab_size, "prompt")
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    sampling = v.make_sampling(body, max_new_tokens=max_tokens, tokens_param="max_tokens",
                               vocab_size=engine.model_config.vocab_size,
                               grammar=await completion_grammar(body.response_format))
    v.check_fits(len(input_ids), max_tokens, engine.max_context, "prompt", "max_tokens")
    chunk = _ChunkBuilder(f"cmpl-{request[REQUEST_ID]}", engine.model_name, len(input_ids))
    async with choices(request, input_ids, sampling, "prompt", body.n) as chosen:
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await stream(request, chosen, _CompletionStream(chunk, include_usage))
        results = await collect(chosen)
        return json_response(chunk.whole([(text, final.finish_reason) for _, text, final in results],
                                         chosen.completion_tokens, chosen.cached_tokens))


def _check_unsupported(body: v.CompletionBody) -> None:
    if body.logprobs is not None:
        raise bad_request("logprobs are not supported", param="logprobs", code="unsupported_parameter")
    if body.echo:
        raise bad_request("echo is not supported", param="echo", code="unsupported_parameter")
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix", code="unsupported_parameter")
    if body.best_of is not None and body.best_of != body.n:
        # Picking the best of more sequences than are returned ranks them by logprob: not yet.
        raise bad_request("best_of must equal n (or be omitted)", param="best_of", code="unsupported_parameter")


async def _prompt_ids(prompt, engine) -> list[int]:
    if isinstance(prompt, list) and not all(isinstance(item, int) for item in prompt):
        if len(prompt) != 1:
            raise bad_request("give one prompt: a string or a list of token ids", param="prompt",
                              code="unsupported_parameter")
        prompt = prompt[0]
        if isinstance(prompt, int):
            prompt = [prompt]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("the prompt is empty", param="prompt")
        return await v.tokenize(engine.tokenizer, prompt, engine.max_context, "prompt")
    return list(prompt)


class _ChunkBuilder:
    def __init__(self, completion_id: str, model: str, prompt_tokens: int):
        self.id = completion_id
        self.model = model
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens

    def _envelope(self, choices: list) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}

    def delta(self, index: int, text: str, finish_reason: str | None) -> dict:
        return self._envelope([_choice(index, text, finish_reason)])

    def usage_only(self, completion_tokens: int, cached_tokens: int) -> dict:
        return {**self._envelope([]), "usage": usage(self.prompt_tokens, completion_tokens, cached_tokens)}

    def whole(self, results: list[tuple[str, str | None]], completion_tokens: int, cached_tokens: int) -> dict:
        """The response from each choice's (text, finish reason)."""
        return {**self._envelope([_choice(i, text, reason) for i, (text, reason) in enumerate(results)]),
                "usage": usage(self.prompt_tokens, completion_tokens, cached_tokens)}


def _choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


class _CompletionStream:
    def __init__(self, chunk: _ChunkBuilder, include_usage: bool):
        self.chunk = chunk
        self.include_usage = include_usage

    def opening(self) -> list:
        return []

    def events(self, index: int, output: RequestOutput) -> list:
        if not output.text and not output.finished:
            return []
        return [self.chunk.delta(index, output.text, output.finish_reason if output.finished else None)]

    def closing(self, chosen) -> list:
        return [self.chunk.usage_only(chosen.completion_tokens, chosen.cached_tokens)] if self.include_usage else []
