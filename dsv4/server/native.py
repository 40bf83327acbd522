"""POST /generate: the native API (SGLang's shape): token ids or text in, ids and text out."""

from __future__ import annotations

import time

from aiohttp import web

from dsv4.protocol import RequestOutput
from dsv4.server import validation as v
from dsv4.server.constraints import native_grammar
from dsv4.server.errors import bad_request
from dsv4.server.ops import json_response
from dsv4.server.state import ARGS, ENGINE, REQUEST_ID
from dsv4.server.streaming import choices, collect, stream


async def generate(request: web.Request) -> web.StreamResponse:
    engine, args = request.app[ENGINE], request.app[ARGS]
    body: v.GenerateBody = await v.decode_body(request, v.GenerateBody, args)
    if (body.input_ids is None) == (body.text is None):
        raise bad_request("give exactly one of input_ids and text", param="input_ids")
    prompt_param = "text" if body.input_ids is None else "input_ids"
    if body.input_ids is None:
        input_ids = await v.tokenize(engine.tokenizer, body.text, engine.max_context, prompt_param)
    else:
        input_ids = body.input_ids
    v.check_prompt_ids(input_ids, engine.model_config.vocab_size, prompt_param)
    params = body.sampling_params
    tokens_param = "sampling_params.max_new_tokens"
    sampling = v.make_sampling(params, max_new_tokens=params.max_new_tokens, tokens_param=tokens_param,
                               vocab_size=engine.model_config.vocab_size, field_prefix="sampling_params.",
                               grammar=await native_grammar(params))
    v.check_fits(len(input_ids), params.max_new_tokens, engine.max_context, prompt_param, tokens_param)
    result = _ResultBuilder(request[REQUEST_ID], len(input_ids))
    async with choices(request, input_ids, sampling, prompt_param) as chosen:
        if body.stream:
            return await stream(request, chosen, _GenerateStream(result, chosen))
        ((token_ids, text, final),) = await collect(chosen)
        return json_response(result.build(token_ids, text, final.finish_reason, len(token_ids)))


class _ResultBuilder:
    def __init__(self, rid: str, prompt_tokens: int):
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.started = time.perf_counter()

    def build(self, output_ids: list[int], text: str, finish_reason: str | None, completion_tokens: int) -> dict:
        return {
            "output_ids": list(output_ids),
            "text": text,
            "meta_info": {
                "id": self.rid,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": completion_tokens,
                "finish_reason": finish_reason,
                "e2e_latency": time.perf_counter() - self.started,
            },
        }


class _GenerateStream:
    """Each event carries the new ids and text; counts and latency are running totals."""

    def __init__(self, result: _ResultBuilder, chosen):
        self.result = result
        self.chosen = chosen

    def opening(self) -> list:
        return []

    def events(self, index: int, output: RequestOutput) -> list:
        if not output.token_ids and not output.finished:
            return []
        finish_reason = output.finish_reason if output.finished else None
        return [self.result.build(output.token_ids, output.text, finish_reason, self.chosen.completion_tokens)]

    def closing(self, chosen) -> list:
        return []
