"""POST /v1/chat/completions: messages in; reasoning, content and tool calls out.

Engine text goes through one dsv4.chat.StreamingChatParser per request, streaming or not, so
both modes agree, DSML markup never reaches `content`, and finish_reason is "tool_calls" only
when a call completed. Output the parser rejects (malformed DSML, an unknown tool) is an error
the client sees, never text passed through.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

from dsv4 import chat
from dsv4.protocol import RequestOutput
from dsv4.server import validation as v
from dsv4.server.chat_prompt import ChatPrompt, build_chat_prompt
from dsv4.server.completions import usage
from dsv4.server.constraints import chat_grammar_for
from dsv4.server.errors import bad_request, server_error
from dsv4.server.http_metrics import HttpMetrics
from dsv4.server.logprobs import TokenText, chat_content
from dsv4.server.ops import json_response
from dsv4.server.state import ARGS, ENGINE, HTTP_METRICS, REQUEST_ID
from dsv4.server.streaming import Collected, choices, collect, stream

log = logging.getLogger(__name__)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine, args = request.app[ENGINE], request.app[ARGS]
    body: v.ChatCompletionBody = await v.decode_body(request, v.ChatCompletionBody, args)
    v.check_model(body.model, engine.model_name)
    v.check_choices(body.n)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    prompt = build_chat_prompt(body)
    grammar = await chat_grammar_for(body, prompt, engine.tokenizer)
    input_ids = await v.tokenize(engine.tokenizer, prompt.text, engine.max_context, "messages")
    tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = max(engine.max_context - len(input_ids), 1)  # OpenAI's default: the rest of the context
    sampling = v.make_sampling(
        body, max_new_tokens=max_tokens, tokens_param=tokens_param, vocab_size=engine.model_config.vocab_size,
        hidden_token_ids=stray_think_markers(engine.tokenizer, prompt.thinking), grammar=grammar,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
    )
    v.check_fits(len(input_ids), max_tokens, engine.max_context, "messages", tokens_param)
    reply = _ChatReply(
        f"chatcmpl-{request[REQUEST_ID]}", engine.model_name, prompt, len(input_ids), request.app[HTTP_METRICS], body.n,
        TokenText(engine.tokenizer) if body.logprobs else None,
    )
    async with choices(request, input_ids, sampling, "messages", body.n) as chosen:
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await stream(request, chosen, _ChatStream(reply, include_usage))
        results = await collect(chosen)
        return json_response(reply.whole(results, chosen.completion_tokens, chosen.cached_tokens))


def stray_think_markers(tokenizer, thinking: bool) -> tuple[int, ...]:
    """Think markers the model may emit but the reply must not carry: the prompt already opened
    the reasoning (thinking) or closed it (chat), so `<think>` is always stray, and so is `</think>`
    in chat mode. They are recognised by id and dropped from the text, never parsed as content."""
    stray = [tokenizer.think_start_id] + ([] if thinking else [tokenizer.think_end_id])
    return tuple(i for i in stray if i is not None)


class _ChatReply:
    """Builds the response objects of one request around its parser."""

    def __init__(self, completion_id: str, model: str, prompt: ChatPrompt, prompt_tokens: int, metrics: HttpMetrics,
                 n: int, token_text: TokenText | None):
        self.id = completion_id
        self.metrics = metrics
        self.model = model
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.thinking = prompt.thinking
        self.token_text = token_text  # None: no logprobs asked
        # One parser per choice, each fed the forced start of the completion first.
        self.parsers = [chat.StreamingChatParser(thinking=prompt.thinking, tools=prompt.tool_names) for _ in range(n)]
        forced = [parser.feed(prompt.forced_start) if prompt.forced_start else [] for parser in self.parsers]
        self.forced_deltas = forced[0]

    def finish(self, index: int, engine_finish_reason: str | None) -> tuple[list[dict], dict]:
        deltas, info = self.parsers[index].finish(engine_finish_reason)
        if info["parse_error"]:
            self.metrics.chat_parse_errors.inc()
            log.warning("%s: model output rejected by the chat parser: %s", self.id, info["error"])
        return deltas, info

    def logprobs(self, entries) -> dict | None:
        return None if self.token_text is None else {"content": chat_content(self.token_text, entries)}

    def chunk(self, index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
        return {**self._envelope("chat.completion.chunk"),
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}

    def usage_chunk(self, completion_tokens: int, cached_tokens: int) -> dict:
        return {**self._envelope("chat.completion.chunk"), "choices": [],
                "usage": usage(self.prompt_tokens, completion_tokens, cached_tokens)}

    def whole(self, results: list[Collected], completion_tokens: int, cached_tokens: int) -> dict:
        """The response from each choice's whole result."""
        return {**self._envelope("chat.completion"),
                "choices": [self._choice(i, result) for i, result in enumerate(results)],
                "usage": usage(self.prompt_tokens, completion_tokens, cached_tokens)}

    def _choice(self, index: int, result: Collected) -> dict:
        self.parsers[index].feed(result.text)
        _, info = self.finish(index, result.final.finish_reason)
        if info["parse_error"]:
            raise invalid_output(info)
        message: dict = {"role": "assistant", "content": info["content"]}
        if self.thinking:
            message["reasoning_content"] = info["reasoning_content"]
        if info["tool_calls"]:
            message["content"] = info["content"] or None
            message["tool_calls"] = [
                {"id": call["id"], "type": "function",
                 "function": {"name": call["name"], "arguments": call["arguments_json"]}}
                for call in info["tool_calls"]
            ]
        return {"index": index, "message": message, "logprobs": self.logprobs(result.logprobs),
                "finish_reason": info["finish_reason"]}

    def _envelope(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def invalid_output(info: dict):
    return server_error(f"the model's output is not a valid reply: {info['error']}", code="invalid_model_output")


class _ChatStream:
    def __init__(self, reply: _ChatReply, include_usage: bool):
        self.reply = reply
        self.include_usage = include_usage
        self.failed = False

    def opening(self) -> list:
        return [chunk for i in range(len(self.reply.parsers)) for chunk in (
            self.reply.chunk(i, {"role": "assistant", "content": ""}),
            *(self.reply.chunk(i, d) for d in self.reply.forced_deltas))]

    def events(self, index: int, output: RequestOutput) -> list:
        """The output's logprobs ride on its first chunk (one with an empty delta when its text
        produced none), so the chunks' logprobs concatenate to the whole reply's."""
        reply = self.reply
        deltas = reply.parsers[index].feed(output.text) if output.text else []
        events = [reply.chunk(index, d) for d in deltas]
        if reply.token_text is not None and output.token_ids:
            logprobs = reply.logprobs(output.logprobs)
            if events:
                events[0]["choices"][0]["logprobs"] = logprobs
            else:
                events.append(reply.chunk(index, {}, logprobs=logprobs))
        if output.finished:
            deltas, info = reply.finish(index, output.finish_reason)
            events += [reply.chunk(index, d) for d in deltas]
            if info["parse_error"]:
                self.failed = True
                events.append(invalid_output(info).body())
            else:
                events.append(reply.chunk(index, {}, info["finish_reason"]))
        return events

    def closing(self, chosen) -> list:
        if self.failed or not self.include_usage:
            return []
        return [self.reply.usage_chunk(chosen.completion_tokens, chosen.cached_tokens)]
