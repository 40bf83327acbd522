"""The shared shape of every generation route: submit, then stream events or collect one result.

A route supplies a translator that turns engine outputs into its own event payloads; this module
owns the order (first output before headers, so a request the engine refuses is still a plain
4xx), failures (an SSE error event then [DONE] once streaming began) and disconnects.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from aiohttp import web

from dsv4.protocol import GenerationRequest, RequestOutput, SamplingParams
from dsv4.server.engine_call import EngineCall
from dsv4.server.errors import ApiError, ClientGone, server_error
from dsv4.server.sse import SSEStream
from dsv4.server.state import ARGS, CLIENT_LEFT, ENGINE, HTTP_METRICS, REQUEST_ID

log = logging.getLogger(__name__)

FAILED = frozenset({"error", "abort"})


class Translator(Protocol):
    def opening(self) -> list: ...
    def events(self, output: RequestOutput) -> list: ...
    def closing(self, call: EngineCall) -> list: ...


def engine_call(request: web.Request, input_ids: list[int], sampling: SamplingParams, prompt_param: str) -> EngineCall:
    generation = GenerationRequest(
        rid=request[REQUEST_ID],
        input_ids=tuple(input_ids),
        sampling=sampling,
        deadline=time.monotonic() + request.app[ARGS].request_timeout,
    )
    return EngineCall(request.app[ENGINE], request, generation, prompt_param)


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


async def stream(request: web.Request, call: EngineCall, translator: Translator) -> web.StreamResponse:
    """Runs inside `async with call`; returns the (already sent) SSE response."""
    output = await next_output(call)  # raises before any header is sent
    if output.finished and output.finish_reason in FAILED:
        raise ClientGone() if call.client_gone() else failure(output)
    sse = SSEStream(request)
    try:
        await sse.open()
        for payload in translator.opening():
            await sse.send(payload)
        while True:
            if output.finished and output.finish_reason in FAILED:
                await sse.send_error(failure(output))
                break
            for payload in translator.events(output):
                await sse.send(payload)
            if output.finished:
                for payload in translator.closing(call):
                    await sse.send(payload)
                break
            output = await next_output(call)
        await sse.close()
    except ClientGone as e:
        request[CLIENT_LEFT] = True
        log.info("request %s: the client went away mid-stream: %s", call.rid, e)
        request.app[HTTP_METRICS].client_disconnects.labels(request.path).inc()
        sse.response.force_close()
    except ApiError as e:
        await _send_final_error(sse, e)
    except Exception:
        log.exception("request %s failed mid-stream", call.rid)
        await _send_final_error(sse, server_error(f"internal error; request id {call.rid}"))
    return sse.response


async def collect(call: EngineCall) -> tuple[list[int], str, RequestOutput]:
    """Waits for the whole result: (token ids, text, final output)."""
    token_ids: list[int] = []
    pieces: list[str] = []
    while True:
        output = await next_output(call)
        if output.finished and output.finish_reason in FAILED:
            raise ClientGone() if call.client_gone() else failure(output)
        token_ids.extend(output.token_ids)
        pieces.append(output.text)
        if output.finished:
            return token_ids, "".join(pieces), output


async def _send_final_error(sse: SSEStream, error: ApiError) -> None:
    try:
        await sse.send_error(error)
        await sse.close()
    except ClientGone:
        pass
