"""POST /v1/completions: a prompt string or token ids in, text out (OpenAI's legacy API)."""

from __future__ import annotations

import time

from aiohttp import web

from dsv4.protocol import RequestOutput
from dsv4.server import validation as v
from dsv4.server.constraints import completion_grammar
from dsv4.server.errors import bad_request
from dsv4.server.logprobs import CompletionLogprobs, TokenText
from dsv4.server.ops import json_response
from dsv4.server.state import ARGS, ENGINE, REQUEST_ID
from dsv4.server.streaming import Collected, choices, collect, stream

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
    # max_tokens 0 with echo returns the prompt (and its logprobs) alone: the one token the engine
    # samples at the prompt's end is computed and dropped.
    prompt_only = body.echo and max_tokens == 0
    engine_tokens = 1 if prompt_only else max_tokens
    sampling = v.make_sampling(body, max_new_tokens=engine_tokens, tokens_param="max_tokens",
                               vocab_size=engine.model_config.vocab_size, logprobs=body.logprobs,
                               prompt_logprobs=body.logprobs if body.echo else None,
                               grammar=await completion_grammar(body.response_format))
    v.check_fits(len(input_ids), engine_tokens, engine.max_context, "prompt", "max_tokens")
    prompt_text = _prompt_text(body.prompt, input_ids, engine.tokenizer) if body.echo or body.logprobs is not None else ""
    shape = _Shape(body, input_ids, prompt_text, prompt_only, TokenText(engine.tokenizer))
    chunk = _ChunkBuilder(f"cmpl-{request[REQUEST_ID]}", engine.model_name, len(input_ids))
    async with choices(request, input_ids, sampling, "prompt", body.n) as chosen:
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await stream(request, chosen, _CompletionStream(chunk, shape, include_usage))
        results = await collect(chosen)
        completion_tokens = 0 if prompt_only else chosen.completion_tokens
        return json_response(chunk.whole([shape.choice(i, r) for i, r in enumerate(results)],
                                         completion_tokens, chosen.cached_tokens))


def _check_unsupported(body: v.CompletionBody) -> None:
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix", code="unsupported_parameter")
    if body.best_of is not None and body.best_of != body.n:
        # Picking the best of more sequences than are returned ranks them by logprob: not yet.
        raise bad_request("best_of must equal n (or be omitted)", param="best_of", code="unsupported_parameter")
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    if max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens must be at least 1 (0 only with echo)", param="max_tokens")


class _Shape:
    """How one request's choices look: the echoed prompt, the generated text, their logprobs."""

    def __init__(self, body: v.CompletionBody, input_ids: list[int], prompt_text: str, prompt_only: bool,
                 text: TokenText):
        self.echo, self.top = body.echo, body.logprobs
        self.input_ids, self.prompt_text, self.prompt_only = input_ids, prompt_text, prompt_only
        self._text = text

    def logprobs(self) -> CompletionLogprobs | None:
        # Offsets index the choice's text, which holds the prompt only when echoed.
        return None if self.top is None else CompletionLogprobs(self._text, 0 if self.echo else len(self.prompt_text))

    def choice(self, index: int, result: Collected) -> dict:
        text = self.prompt_text if self.echo else ""
        logprobs = self.logprobs()
        if logprobs is not None and self.echo:
            logprobs.extend(self.input_ids, result.prompt_logprobs)
        if not self.prompt_only:
            text += result.text
            if logprobs is not None:
                logprobs.extend(result.token_ids, result.logprobs)
        return _choice(index, text, None if logprobs is None else logprobs.take(), result.final.finish_reason)


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


def _prompt_text(prompt, input_ids: list[int], tokenizer) -> str:
    """The prompt as text: as given, or decoded from the token ids given."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else tokenizer.decode(input_ids)


class _ChunkBuilder:
    def __init__(self, completion_id: str, model: str, prompt_tokens: int):
        self.id = completion_id
        self.model = model
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens

    def _envelope(self, choices: list) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}

    def delta(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
        return self._envelope([_choice(index, text, logprobs, finish_reason)])

    def usage_only(self, completion_tokens: int, cached_tokens: int) -> dict:
        return {**self._envelope([]), "usage": usage(self.prompt_tokens, completion_tokens, cached_tokens)}

    def whole(self, choices: list[dict], completion_tokens: int, cached_tokens: int) -> dict:
        return {**self._envelope(choices), "usage": usage(self.prompt_tokens, completion_tokens, cached_tokens)}


def _choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


class _CompletionStream:
    """Each choice's first event carries the echoed prompt (and its logprobs) before its first token."""

    def __init__(self, chunk: _ChunkBuilder, shape: _Shape, include_usage: bool):
        self.chunk = chunk
        self.shape = shape
        self.include_usage = include_usage
        self.logprobs: dict[int, CompletionLogprobs | None] = {}  # by choice, once started

    def opening(self) -> list:
        return []

    def events(self, index: int, output: RequestOutput) -> list:
        shape = self.shape
        text = ""
        if index not in self.logprobs:
            logprobs = self.logprobs[index] = shape.logprobs()
            if shape.echo:
                text = shape.prompt_text
                if logprobs is not None:
                    logprobs.extend(shape.input_ids, output.prompt_logprobs)
        logprobs = self.logprobs[index]
        if not shape.prompt_only:
            text += output.text
            if logprobs is not None:
                logprobs.extend(output.token_ids, output.logprobs)
        pending = logprobs is not None and logprobs.tokens
        if not text and not pending and not output.finished:
            return []
        return [self.chunk.delta(index, text, logprobs.take() if logprobs is not None else None,
                                 output.finish_reason if output.finished else None)]

    def closing(self, chosen) -> list:
        if not self.include_usage:
            return []
        completion_tokens = 0 if self.shape.prompt_only else chosen.completion_tokens
        return [self.chunk.usage_only(completion_tokens, chosen.cached_tokens)]
