"""The one error shape every route returns, OpenAI style: {"error": {message, type, param, code}}."""

from __future__ import annotations

import msgspec
from aiohttp import web


class ApiError(Exception):
    """A failure the client should see as JSON; `param` names the offending request field."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        close_connection: bool = False,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.close_connection = close_connection  # the connection is in an unknown state (half a body)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_response(self, headers: dict | None = None) -> web.Response:
        response = web.Response(
            status=self.status, body=msgspec.json.encode(self.body()), content_type="application/json", headers=headers
        )
        if self.close_connection:
            response.force_close()
        return response


class ClientGone(Exception):
    """The client closed its connection; nothing more can be sent to it."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def server_error(message: str, code: str | None = None, status: int = 500) -> ApiError:
    return ApiError(status, message, code=code, type="server_error")
