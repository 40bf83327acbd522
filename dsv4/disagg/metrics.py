"""Prometheus collectors of one disaggregation side, in their own registry (one per instance)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class DisaggMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.transfers = Counter(
            "dsv4_pd_transfers", "Transfers by final outcome", ["outcome"], registry=self.registry
        )
        self.bytes = Counter("dsv4_pd_transfer_bytes", "Payload bytes moved", registry=self.registry)
        self.latency = Histogram(
            "dsv4_pd_transfer_seconds",
            "From prefill request to commit (decode) or commit sent (prefill)",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.aborts = Counter("dsv4_pd_aborts", "Aborts by origin", ["origin"], registry=self.registry)
        self.drains = Counter("dsv4_pd_drains", "Drain acknowledgements received or sent", registry=self.registry)
        self.fenced = Counter("dsv4_pd_fenced_leases", "Peers fenced (endpoint closed) to end a lease",
                              registry=self.registry)
        self.dropped_frames = Counter(
            "dsv4_pd_dropped_frames", "Frames counted and dropped, by reason", ["reason"], registry=self.registry
        )
        self.task_deaths = Counter("dsv4_pd_task_deaths", "Supervised tasks that died", ["task"],
                                   registry=self.registry)
        self.request_task_errors = Counter(
            "dsv4_pd_request_task_errors", "Unexpected exceptions that failed one request (not the instance)",
            ["task"], registry=self.registry)

    def sample(self, name: str, **labels) -> float:
        """A counter's current value (0 when never incremented); for tests and summaries."""
        return self.registry.get_sample_value(name + "_total", labels) or 0.0
