"""Typed keys for what handlers find on the application."""

from __future__ import annotations

from aiohttp import web

from dsv4.config import ServerArgs
from dsv4.server.http_metrics import HttpMetrics

ENGINE = web.AppKey("engine", object)  # dsv4.engine.engine.Engine, or a test double with its API
ARGS = web.AppKey("args", ServerArgs)
HTTP_METRICS = web.AppKey("http_metrics", HttpMetrics)

REQUEST_ID = web.RequestKey("request_id", str)
