"""Operational routes: liveness, readiness, Prometheus metrics, debug views and the model list."""

from __future__ import annotations

import time

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dsv4.server.state import ENGINE, HTTP_METRICS, LIFECYCLE

_STARTED = int(time.time())


def json_response(payload, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(payload), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    # Liveness: the event loop turns and the engine can still serve (a dead tick loop is not alive,
    # so a supervisor restarts the process). Readiness is /health/ready.
    alive, reason = request.app[ENGINE].alive()
    if not alive:
        return json_response({"status": "dead", "reason": reason}, status=503)
    return json_response({"status": "ok"})


async def health_ready(request: web.Request) -> web.Response:
    ready, reasons = request.app[ENGINE].ready()
    if request.app[LIFECYCLE].draining:  # after the engine's reasons: why it stopped comes first
        ready, reasons = False, [*reasons, "the server is shutting down"]
    return json_response({"ready": ready, "reasons": list(reasons)}, status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[ENGINE].metrics.registry) + generate_latest(request.app[HTTP_METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def debug_requests(request: web.Request) -> web.Response:
    return json_response(request.app[ENGINE].debug_requests())


async def list_models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    model = {
        "id": engine.model_name,
        "object": "model",
        "created": _STARTED,
        "owned_by": "dsv4",
        "max_model_len": engine.max_context,
    }
    return json_response({"object": "list", "data": [model]})
