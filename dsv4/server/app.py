"""The HTTP front: an aiohttp application over an Engine (never touches tensors).

`build_app(engine, args)` wires routes and middleware; `run_server(engine, args)` blocks: it
starts the engine, serves on args.host:args.port under uvloop and, on SIGINT or SIGTERM, stops
accepting, gives in-flight requests `SHUTDOWN_GRACE_SECONDS` to finish (requests cut off there
are aborted in the engine by their handlers), then stops the engine.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvloop
from aiohttp import web

from dsv4.config import ServerArgs
from dsv4.server import chat_completions, completions, native, ops
from dsv4.server.http_metrics import HttpMetrics
from dsv4.server.middleware import add_request_id_header, guard
from dsv4.server.state import ARGS, ENGINE, HTTP_METRICS

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_SECONDS = 10.0


def build_app(engine, args: ServerArgs) -> web.Application:
    app = web.Application(middlewares=[guard], client_max_size=args.max_request_bytes)
    app[ENGINE] = engine
    app[ARGS] = args
    app[HTTP_METRICS] = HttpMetrics()
    app.on_response_prepare.append(add_request_id_header)
    app.router.add_post("/v1/chat/completions", chat_completions.chat_completions)
    app.router.add_post("/v1/completions", completions.completions)
    app.router.add_get("/v1/models", ops.list_models)
    app.router.add_post("/generate", native.generate)
    app.router.add_get("/health", ops.health)
    app.router.add_get("/health/ready", ops.health_ready)
    app.router.add_get("/metrics", ops.metrics)
    app.router.add_get("/debug/requests", ops.debug_requests)
    return app


def run_server(engine, args: ServerArgs) -> None:
    uvloop.run(serve(engine, args))


async def serve(engine, args: ServerArgs) -> None:
    """Serves until SIGINT or SIGTERM (the async body of run_server, for callers with a loop)."""
    await engine.start()
    runner = web.AppRunner(build_app(engine, args), access_log=None, shutdown_timeout=SHUTDOWN_GRACE_SECONDS)
    try:
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        log.info("serving %s on http://%s:%d", engine.model_name, args.host, args.port)
        await _until_signalled()
        log.info("shutting down: finishing in-flight requests (up to %.0f s)", SHUTDOWN_GRACE_SECONDS)
    finally:
        await runner.cleanup()
        await engine.stop()


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
