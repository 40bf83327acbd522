"""POST /generate: the native API (SGLang's shape): token ids or text in, ids and text out.

With `return_logprob`, `meta_info` carries SGLang's `output_token_logprobs` and `output_top_logprobs`
and, from prompt position `logprob_start_len` on (-1: none), `input_token_logprobs` and
`input_top_logprobs`: `[logprob, token_id, text]` entries (text null unless
`return_text_in_logprobs`; the logprob of prompt position 0 is null). Streaming events carry each
event's own output entries, the first one the input entries too.
"""

from __future__ import annotations

import time

from aiohttp import web

from dsv4.protocol import RequestOutput
from dsv4.server import validation as v
from dsv4.server.constraints import native_grammar
from dsv4.server.errors import bad_request
from dsv4.server.logprobs import TokenText, native_entries
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
    if body.logprob_start_len < -1:
        raise bad_request(f"logprob_start_len must be -1 or at least 0, got {body.logprob_start_len}",
                          param="logprob_start_len")
    with_prompt = body.return_logprob and 0 <= body.logprob_start_len < len(input_ids)
    sampling = v.make_sampling(params, max_new_tokens=params.max_new_tokens, tokens_param=tokens_param,
                               vocab_size=engine.model_config.vocab_size, field_prefix="sampling_params.",
                               grammar=await native_grammar(params),
                               logprobs=body.top_logprobs_num if body.return_logprob else None,
                               prompt_logprobs=body.top_logprobs_num if with_prompt else None,
                               prompt_logprobs_start=max(body.logprob_start_len, 0))
    v.check_fits(len(input_ids), params.max_new_tokens, engine.max_context, prompt_param, tokens_param)
    logprobs = None
    if body.return_logprob:
        text = TokenText(engine.tokenizer) if body.return_text_in_logprobs else None
        logprobs = _Logprobs(text, input_ids[max(body.logprob_start_len, 0):] if with_prompt else [])
    result = _ResultBuilder(request[REQUEST_ID], len(input_ids), logprobs)
    async with choices(request, input_ids, sampling, prompt_param) as chosen:
        if body.stream:
            return await stream(request, chosen, _GenerateStream(result, chosen))
        (whole,) = await collect(chosen)
        return json_response(result.build(whole.token_ids, whole.text, whole.final.finish_reason,
                                          len(whole.token_ids), whole.logprobs, whole.prompt_logprobs))


class _Logprobs:
    """SGLang's logprob fields of `meta_info`."""

    def __init__(self, text: TokenText | None, prompt_ids: list[int]):
        self.text = text
        self.prompt_ids = prompt_ids  # from logprob_start_len on

    def fields(self, token_ids, entries, prompt_entries) -> dict:
        output, output_top = native_entries(self.text, entries, token_ids)
        if prompt_entries is None:
            prompt, prompt_top = [], []
        else:
            prompt, prompt_top = native_entries(self.text, prompt_entries, self.prompt_ids)
        return {"input_token_logprobs": prompt, "output_token_logprobs": output,
                "input_top_logprobs": prompt_top, "output_top_logprobs": output_top}


class _ResultBuilder:
    def __init__(self, rid: str, prompt_tokens: int, logprobs: _Logprobs | None):
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.logprobs = logprobs
        self.started = time.perf_counter()

    def build(self, output_ids: list[int], text: str, finish_reason: str | None, completion_tokens: int,
              logprobs=(), prompt_logprobs=None) -> dict:
        meta = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "finish_reason": finish_reason,
            "e2e_latency": time.perf_counter() - self.started,
        }
        if self.logprobs is not None:
            meta.update(self.logprobs.fields(output_ids, logprobs, prompt_logprobs))
        return {"output_ids": list(output_ids), "text": text, "meta_info": meta}


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
        return [self.result.build(output.token_ids, output.text, finish_reason, self.chosen.completion_tokens,
                                  output.logprobs, output.prompt_logprobs)]

    def closing(self, chosen) -> list:
        return []
