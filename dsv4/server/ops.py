"""Operational routes: liveness, readiness, Prometheus metrics, debug views and the model list."""

from __future__ import annotations

import time

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dsv4.server.state import ENGINE, HTTP_METRICS

_STARTED = int(time.time())


def json_response(payload, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(payload), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    # Liveness only: answering at all proves the event loop turns. Readiness is /health/ready.
    return json_response({"status": "ok"})


async def health_ready(request: web.Request) -> web.Response:
    ready, reasons = request.app[ENGINE].ready()
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
