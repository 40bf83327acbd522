"""One engine request bound to one HTTP request: the engine forgets it whenever the client does.

The engine holds pages and a slot for every running request, so a request whose client has gone
must be aborted promptly, whether the handler is streaming, waiting for a non-stream result or
still queued before its first token. Three things guarantee it: a watcher that notices the
connection closing while the handler waits, SSE writes that fail once the client has gone,
and an abort in `__aexit__` for any request that did not finish, whatever ended the handler.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Self

from aiohttp import web

from dsv4.engine.request import AdmissionError
from dsv4.protocol import GenerationRequest, RequestOutput
from dsv4.server.errors import bad_request, server_error

log = logging.getLogger(__name__)

DISCONNECT_POLL_SECONDS = 0.25
# The engine ends every request by its deadline; past it by this much, the server stops waiting
# (and aborts), so a broken engine cannot hold a client forever.
ENGINE_ANSWER_GRACE_SECONDS = 60.0


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class EngineCall:
    """`async with EngineCall(...) as call: async for out in call: ...`"""

    def __init__(self, engine, request: web.Request, generation: GenerationRequest, prompt_param: str):
        self._engine = engine
        self._request = request
        self.generation = generation
        self._prompt_param = prompt_param
        self._outputs = None
        self._watcher: asyncio.Task | None = None
        self.finished = False
        self._aborted = False
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the prefix cache served (every output carries it)

    @property
    def rid(self) -> str:
        return self.generation.rid

    def client_gone(self) -> bool:
        return client_gone(self._request)

    async def __aenter__(self) -> Self:
        try:
            self._outputs = aiter(self._engine.submit(self.generation))
        except AdmissionError as e:  # this request can never fit
            raise self._not_admitted(e) from None
        self._watcher = asyncio.create_task(self._abort_when_client_leaves(), name=f"watch-client-{self.rid}")
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._watcher.cancel()
        if not self.finished:
            self._abort("client disconnected" if client_gone(self._request) else "handler ended")
        close = getattr(self._outputs, "aclose", None)
        if close is not None:
            await close()

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        patience = self.generation.deadline - time.monotonic() + ENGINE_ANSWER_GRACE_SECONDS
        try:
            async with asyncio.timeout(patience):
                output = await anext(self._outputs)
        except TimeoutError:
            raise server_error(f"the engine did not answer within {ENGINE_ANSWER_GRACE_SECONDS:.0f} s of the "
                               "request's deadline", code="engine_timeout") from None
        except StopAsyncIteration:
            raise  # without a finished output: __aexit__ still aborts, in case the engine kept anything
        except AdmissionError as e:
            # An async-generator submit() raises only once iterated.
            self.finished = True
            raise self._not_admitted(e) from None
        self.completion_tokens += len(output.token_ids)
        self.cached_tokens = output.cached_tokens
        self.finished = output.finished
        return output

    async def _abort_when_client_leaves(self) -> None:
        while not client_gone(self._request):
            await asyncio.sleep(DISCONNECT_POLL_SECONDS)
        log.info("client of %s disconnected; aborting", self.rid)
        self._abort("client disconnected")

    def _abort(self, reason: str) -> None:
        if not self._aborted:
            self._aborted = True
            self._engine.abort(self.rid, reason)

    def _not_admitted(self, error: AdmissionError):
        return bad_request(str(error), param=self._prompt_param, code="context_length_exceeded")
