"""Server-sent events: one `data: <json>` frame per event, `data: [DONE]` last, as OpenAI streams."""

from __future__ import annotations

import msgspec
from aiohttp import web

from dsv4.server.errors import ApiError, ClientGone

_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # a buffering proxy would hold tokens back
}
_DONE = b"data: [DONE]\n\n"


def frame(payload) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


class SSEStream:
    """Writes events to one client; every failed write raises ClientGone."""

    def __init__(self, request: web.Request, headers: dict | None = None):
        self._request = request
        self.response = web.StreamResponse(status=200, headers={**_HEADERS, **(headers or {})})

    async def open(self) -> None:
        await self._write(self.response.prepare(self._request))

    async def send(self, payload) -> None:
        await self._write(self.response.write(frame(payload)))

    async def send_error(self, error: ApiError) -> None:
        await self.send(error.body())

    async def close(self) -> None:
        """Ends the stream with [DONE]."""
        await self._write(self.response.write(_DONE))
        await self._write(self.response.write_eof())

    @staticmethod
    async def _write(awaitable) -> None:
        try:
            await awaitable
        except (ConnectionError, OSError) as e:  # aiohttp raises ClientConnectionResetError here
            raise ClientGone(str(e)) from e
