"""HTTP-level Prometheus metrics, in their own registry so several apps can live in one process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class HttpMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dsv4_http_requests", "HTTP requests answered, by route, method and status",
            ["route", "method", "status"], registry=self.registry,
        )
        self.duration = Histogram(
            "dsv4_http_request_duration_seconds", "Time from request to the last byte, by route",
            ["route"], registry=self.registry,
            buckets=(0.005, 0.02, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        self.in_flight = Gauge("dsv4_http_requests_in_flight", "HTTP requests being answered", registry=self.registry)
        self.client_disconnects = Counter(
            "dsv4_http_client_disconnects", "Generation requests whose client left before the end", ["route"],
            registry=self.registry,
        )

        self.chat_parse_errors = Counter(
            "dsv4_chat_parse_errors", "Chat replies whose model output the DSML/reasoning parser rejected",
            registry=self.registry,
        )

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.duration.labels(route).observe(seconds)
