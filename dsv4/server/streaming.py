"""The shared shape of every generation route: submit, then stream events or collect the result.

A request asks for `n` choices: parallel sequences of one prompt, each its own engine request
(`Choices`). A route supplies a translator that turns each choice's engine outputs into its own
event payloads; this module owns the order (first output before headers, so a request the engine
refuses is still a plain 4xx), failures (an SSE error event then [DONE] once streaming began; one
failed choice fails the request and ends the others) and disconnects.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Protocol, Self

import msgspec
from aiohttp import web

from dsv4.protocol import GenerationRequest, RequestOutput, SamplingParams, TokenLogprob
from dsv4.server.engine_call import EngineCall
from dsv4.server.errors import ApiError, ClientGone, server_error
from dsv4.server.sse import SSEStream
from dsv4.server.state import ARGS, CLIENT_LEFT, ENGINE, HTTP_METRICS, REQUEST_ID

log = logging.getLogger(__name__)

FAILED = frozenset({"error", "abort"})
_INT64 = 2**64


class Translator(Protocol):
    def opening(self) -> list: ...
    def events(self, index: int, output: RequestOutput) -> list: ...
    def closing(self, choices: Choices) -> list: ...


class Choices:
    """The `n` sequences of one request, as one stream of (choice index, output).

    Choice i is engine request `<request id>-<i>` (the request id itself when n is 1) with seed
    `seed + i`, so seeded choices differ from each other and reproduce. The first choice runs alone
    until its first output, by which time its prompt is computed: the others then find the prompt's
    full pages in the prefix cache instead of computing them again. Every unfinished choice is
    aborted when the request ends, whatever ended it.
    """

    def __init__(self, calls: list[EngineCall]):
        self.calls = calls
        self._stack = AsyncExitStack()
        self._pending: dict[int, asyncio.Task] = {}
        self._first: RequestOutput | None = None

    @property
    def rid(self) -> str:
        return self.calls[0].rid

    @property
    def finished(self) -> bool:
        return all(call.finished for call in self.calls)

    @property
    def completion_tokens(self) -> int:
        return sum(call.completion_tokens for call in self.calls)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served by the prefix cache, counted once like the prompt itself."""
        return max(call.cached_tokens for call in self.calls)

    def client_gone(self) -> bool:
        return self.calls[0].client_gone()

    async def __aenter__(self) -> Self:
        await self._stack.__aenter__()
        try:
            await self._stack.enter_async_context(self.calls[0])
            if len(self.calls) > 1:
                self._first = await next_output(self.calls[0])
                if not self._first.finished or self._first.finish_reason not in FAILED:
                    for call in self.calls[1:]:
                        await self._stack.enter_async_context(call)
        except BaseException:
            await self._stack.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        for task in self._pending.values():
            task.cancel()
        await asyncio.gather(*self._pending.values(), return_exceptions=True)
        await self._stack.__aexit__(*exc_info)

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if self._first is not None:
            first, self._first = self._first, None
            return 0, first
        if len(self.calls) == 1:  # (one choice: its outputs in turn, without a task and a wait per output)
            call = self.calls[0]
            if call.finished:
                raise StopAsyncIteration
            return 0, await next_output(call)
        for i, call in enumerate(self.calls):
            if not call.finished and i not in self._pending:
                self._pending[i] = asyncio.ensure_future(next_output(call))
        if not self._pending:
            raise StopAsyncIteration
        done, _ = await asyncio.wait(self._pending.values(), return_when=asyncio.FIRST_COMPLETED)
        index = min(i for i, task in self._pending.items() if task in done)
        return index, self._pending.pop(index).result()


def choices(request: web.Request, input_ids: list[int], sampling: SamplingParams, prompt_param: str,
            n: int = 1) -> Choices:
    deadline = time.monotonic() + request.app[ARGS].request_timeout
    calls = []
    for i in range(n):
        seeded = sampling if sampling.seed is None or i == 0 else msgspec.structs.replace(
            sampling, seed=(sampling.seed + i + _INT64 // 2) % _INT64 - _INT64 // 2)  # stays in int64
        rid = request[REQUEST_ID] if n == 1 else f"{request[REQUEST_ID]}-{i}"
        generation = GenerationRequest(rid=rid, input_ids=tuple(input_ids), sampling=seeded, deadline=deadline)
        calls.append(EngineCall(request.app[ENGINE], request, generation, prompt_param))
    return Choices(calls)


def failure(output: RequestOutput) -> ApiError:
    reason = output.error or f"request ended with finish_reason {output.finish_reason!r}"
    if 400 <= output.error_status < 500:
        return ApiError(output.error_status, reason, code=output.finish_reason)
    return server_error(reason, code=output.finish_reason, status=output.error_status)


async def next_output(call: EngineCall) -> RequestOutput:
    try:
        return await anext(call)
    except StopAsyncIteration:
        raise server_error("the engine ended the request without a final result") from None


async def stream(request: web.Request, choices: Choices, translator: Translator) -> web.StreamResponse:
    """Runs inside `async with choices`; returns the (already sent) SSE response."""
    index, output = await anext(choices)  # raises before any header is sent
    if output.finished and output.finish_reason in FAILED:
        raise ClientGone() if choices.client_gone() else failure(output)
    sse = SSEStream(request)
    try:
        await sse.open()
        for payload in translator.opening():
            await sse.send(payload)
        while True:
            if output.finished and output.finish_reason in FAILED:
                await sse.send_error(failure(output))
                break
            for payload in translator.events(index, output):
                await sse.send(payload)
            if choices.finished:
                for payload in translator.closing(choices):
                    await sse.send(payload)
                break
            index, output = await anext(choices)
        await sse.close()
    except ClientGone as e:
        request[CLIENT_LEFT] = True
        log.info("request %s: the client went away mid-stream: %s", choices.rid, e)
        request.app[HTTP_METRICS].client_disconnects.labels(request.path).inc()
        sse.response.force_close()
    except ApiError as e:
        await _send_final_error(sse, e)
    except Exception:
        log.exception("request %s failed mid-stream", choices.rid)
        await _send_final_error(sse, server_error(f"internal error; request id {choices.rid}"))
    return sse.response


@dataclass
class Collected:
    """One choice's whole result."""

    token_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when asked
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    final: RequestOutput | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


async def collect(choices: Choices) -> list[Collected]:
    """Waits for every choice's whole result, in choice order."""
    results = [Collected() for _ in choices.calls]
    async for index, output in choices:
        if output.finished and output.finish_reason in FAILED:
            raise ClientGone() if choices.client_gone() else failure(output)
        result = results[index]
        result.token_ids.extend(output.token_ids)
        result.pieces.append(output.text)
        result.logprobs.extend(output.logprobs)
        if output.prompt_logprobs is not None:
            result.prompt_logprobs = output.prompt_logprobs
        if output.finished:
            result.final = output
    return results


async def _send_final_error(sse: SSEStream, error: ApiError) -> None:
    try:
        await sse.send_error(error)
        await sse.close()
    except ClientGone:
        pass
