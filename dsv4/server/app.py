"""The HTTP front: an aiohttp application over an Engine (never touches tensors).

`build_app(engine, args)` wires routes and middleware; `run_server(engine, args)` blocks until
SIGINT/SIGTERM (a graceful drain, exit code 0) or the engine's death (exit code 1); see
dsv4/server/lifecycle.py.
"""

from __future__ import annotations

import logging

import uvloop
from aiohttp import web

from dsv4.config import ServerArgs
from dsv4.engine.launch import settle_heap
from dsv4.server import chat_completions, completions, native, ops, tokenize
from dsv4.server.http_metrics import HttpMetrics
from dsv4.server.lifecycle import FLUSH_SECONDS, Lifecycle, drain, until_signalled_or_dead
from dsv4.server.middleware import add_request_id_header, guard
from dsv4.server.state import ARGS, ENGINE, HTTP_METRICS, LIFECYCLE

log = logging.getLogger(__name__)

# aiohttp's own wait for handlers at cleanup: by then every request has been ended.
CLEANUP_TIMEOUT_SECONDS = 1.0


def build_app(engine, args: ServerArgs) -> web.Application:
    app = web.Application(middlewares=[guard], client_max_size=args.max_request_bytes)
    app[ENGINE] = engine
    app[ARGS] = args
    app[HTTP_METRICS] = HttpMetrics()
    app[LIFECYCLE] = Lifecycle()
    app.on_response_prepare.append(add_request_id_header)
    app.router.add_post("/v1/chat/completions", chat_completions.chat_completions)
    app.router.add_post("/v1/completions", completions.completions)
    app.router.add_get("/v1/models", ops.list_models)
    app.router.add_post("/generate", native.generate)
    app.router.add_post("/tokenize", tokenize.tokenize)
    app.router.add_post("/detokenize", tokenize.detokenize)
    app.router.add_get("/health", ops.health)
    app.router.add_get("/health/ready", ops.health_ready)
    app.router.add_get("/metrics", ops.metrics)
    app.router.add_get("/debug/requests", ops.debug_requests)
    return app


def run_server(engine, args: ServerArgs) -> int:
    """Serves until stopped; returns the process exit code."""
    return uvloop.run(serve(engine, args))


async def serve(engine, args: ServerArgs) -> int:
    """The async body of run_server, for callers with a loop: 0 after a signal, 1 if the engine died."""
    await engine.start()
    app = build_app(engine, args)
    lifecycle = app[LIFECYCLE]
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=CLEANUP_TIMEOUT_SECONDS,
                           keepalive_timeout=args.timeout_keep_alive)
    try:
        await runner.setup()
        settle_heap()  # (before the port opens: no request waits out its collection)
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        log.info("serving %s on http://%s:%d", engine.model_name, args.host, args.port)
        signalled = await until_signalled_or_dead(engine)
        await site.stop()  # accept no more connections
        if signalled:
            await drain(lifecycle, engine, args.shutdown_timeout)
            return 0
        lifecycle.draining = True
        log.critical("exiting: %s", engine.alive()[1])
        await lifecycle.wait_idle(FLUSH_SECONDS)  # the engine has ended every request: let them be sent
        return 1
    finally:
        await runner.cleanup()
        await engine.stop()
