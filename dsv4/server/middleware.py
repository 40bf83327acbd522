"""Cross-cutting HTTP concerns: request ids, API-key checks, JSON errors, HTTP metrics.

Whatever goes wrong, the client gets the JSON error shape and never a traceback; an unexpected
exception is logged with the request id the client sees in its 500 and in `X-Request-Id`.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid

from aiohttp import web

from dsv4.server.errors import ApiError, ClientGone, server_error
from dsv4.server.state import ARGS, CLIENT_LEFT, HTTP_METRICS, LIFECYCLE, REQUEST_ID

log = logging.getLogger(__name__)

# Probes and scrapers must work without the API key.
OPEN_PATHS = frozenset({"/health", "/health/ready", "/metrics"})

# nginx's "client closed request": only metrics and logs ever see it.
CLIENT_CLOSED_REQUEST = 499

_HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


@web.middleware
async def guard(request: web.Request, handler):
    request[REQUEST_ID] = uuid.uuid4().hex
    metrics = request.app[HTTP_METRICS]
    lifecycle = request.app[LIFECYCLE]
    tracked = request.path not in OPEN_PATHS  # probes stay answerable while draining, and never wait
    started = time.perf_counter()
    status = 500
    metrics.in_flight.inc()
    if tracked:
        lifecycle.enter()
    try:
        if tracked and lifecycle.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down", type="server_error")
        _check_api_key(request)
        response = await handler(request)
        status = CLIENT_CLOSED_REQUEST if request.get(CLIENT_LEFT) else response.status
        return response
    except ApiError as e:
        status = e.status
        return e.to_response()
    except ClientGone as e:
        status = CLIENT_CLOSED_REQUEST
        log.info("request %s (%s %s): the client went away: %s", request[REQUEST_ID], request.method,
                 request.path, e)
        metrics.client_disconnects.labels(request.path).inc()
        return web.Response(status=CLIENT_CLOSED_REQUEST)
    except web.HTTPException as e:  # routing failures and aiohttp's own limits
        status = e.status
        error = ApiError(e.status, _describe(request, e), code=_HTTP_ERROR_CODES.get(e.status))
        allow = e.headers.get("Allow")
        return error.to_response(headers={"Allow": allow} if allow else None)
    except Exception:
        log.exception("request %s (%s %s) failed", request[REQUEST_ID], request.method, request.path)
        return server_error(f"internal error; request id {request[REQUEST_ID]}").to_response()
    finally:
        if tracked:
            lifecycle.leave()
        metrics.in_flight.dec()
        metrics.observe(_route_label(request), request.method, status, time.perf_counter() - started)


async def add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare hook: covers streams, whose headers leave before the handler returns.
    While draining, connections are not kept alive past their response."""
    request_id = request.get(REQUEST_ID)
    if request_id:
        response.headers["X-Request-Id"] = request_id
    if request.app[LIFECYCLE].draining:
        response.force_close()
        response.headers["Connection"] = "close"  # headers are computed before this hook runs


def _check_api_key(request: web.Request) -> None:
    key = request.app[ARGS].api_key
    if not key or request.path in OPEN_PATHS:
        return
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise ApiError(401, "missing or incorrect API key; send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


def _describe(request: web.Request, e: web.HTTPException) -> str:
    if e.status == 404:
        return f"no route {request.path}"
    if e.status == 405:
        return f"method {request.method} is not allowed on {request.path}; allowed: {e.headers.get('Allow', '')}"
    return e.text or e.reason


def _route_label(request: web.Request) -> str:
    # The route template, not the raw path, so that label values stay few.
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"
