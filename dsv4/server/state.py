"""Typed keys for what handlers find on the application."""

from __future__ import annotations

from aiohttp import web

from dsv4.config import ServerArgs
from dsv4.server.http_metrics import HttpMetrics
from dsv4.server.lifecycle import Lifecycle

ENGINE = web.AppKey("engine", object)  # dsv4.engine.engine.Engine, or a test double with its API
ARGS = web.AppKey("args", ServerArgs)
HTTP_METRICS = web.AppKey("http_metrics", HttpMetrics)
LIFECYCLE = web.AppKey("lifecycle", Lifecycle)

REQUEST_ID = web.RequestKey("request_id", str)
CLIENT_LEFT = web.RequestKey("client_left", bool)  # the client went away mid-response (counted as 499)
