"""The engine's Prometheus collectors, in a registry of their own (the server renders it at /metrics)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKEN_INTERVAL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
_COLLECTIVE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 2.0, 10.0, 30.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running_requests = Gauge("dsv4_running_requests", "Requests holding a slot", registry=r)
        self.waiting_requests = Gauge("dsv4_waiting_requests", "Requests queued for admission", registry=r)
        self.prompt_tokens = Counter(
            "dsv4_prompt_tokens", "Prompt tokens of requests whose prefill completed (a recompute counts once)",
            registry=r,
        )
        self.generation_tokens = Counter("dsv4_generation_tokens", "Tokens generated", registry=r)
        self.time_to_first_token = Histogram(
            "dsv4_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.inter_token_latency = Histogram(
            "dsv4_inter_token_latency_seconds", "Between consecutive tokens of a request",
            buckets=_TOKEN_INTERVAL_BUCKETS, registry=r,
        )
        self.e2e_latency = Histogram(
            "dsv4_e2e_request_latency_seconds", "Arrival to last output", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.ticks = Counter("dsv4_ticks", "Ticks run", registry=r)
        self.preemptions = Counter(
            "dsv4_preemptions", "Running requests retracted for KV pages, to be recomputed and resumed", registry=r
        )
        self.tick_duration = Histogram(
            "dsv4_tick_duration_seconds", "Plan, forward, sample and deliver of one tick",
            buckets=_TOKEN_INTERVAL_BUCKETS, registry=r,
        )
        self.free_pages = Gauge("dsv4_free_pages", "KV pages free", registry=r)
        self.total_pages = Gauge("dsv4_total_pages", "KV pages in the pool", registry=r)
        self.free_slots = Gauge("dsv4_free_slots", "Request state slots free", registry=r)
        self.total_slots = Gauge("dsv4_total_slots", "Request state slots", registry=r)
        self.finished_requests = Counter(
            "dsv4_finished_requests", "Requests ended, by finish reason", ["reason"], registry=r
        )
        for reason in FINISH_REASONS:
            self.finished_requests.labels(reason=reason)  # export zeros so rates exist from the start
        self.request_errors = Counter(
            "dsv4_request_errors", "Requests ended by an error of their own while the engine went on, by stage",
            ["stage"], registry=r,
        )
        self.collective_seconds = Histogram(
            "dsv4_collective_seconds", "Tensor parallelism: one collective on rank 0, by op",
            ["op"], buckets=_COLLECTIVE_BUCKETS, registry=r,
        )
        # --verify-indexer
        self.indexer_verified = Counter(
            "dsv4_indexer_verified", "Indexer selections (token x CSA layer) checked against the reference",
            registry=r,
        )
        self.indexer_mismatches = Counter(
            "dsv4_indexer_mismatch", "Indexer selections that failed the reference check, by layer", ["layer"],
            registry=r,
        )

    def track_indexer_layers(self, layers) -> None:
        """Exports a zero mismatch count for each verified layer, so a clean run says so."""
        for layer in layers:
            self.indexer_mismatches.labels(layer=str(layer))

    def watch_capacity(self, capacity: Callable[[], dict], running: Callable[[], int],
                       waiting: Callable[[], int]) -> None:
        """The capacity gauges read when /metrics renders (on the event loop thread, which owns what they
        read), not set at every tick: six locked sets and a snapshot took the tick's tail from 3 to 19 us
        in situ (c=1 decode), and a scrape now sees the state of that moment."""
        for gauge, key in ((self.free_pages, "free_pages"), (self.total_pages, "total_pages"),
                           (self.free_slots, "free_slots"), (self.total_slots, "total_slots")):
            gauge.set_function(lambda key=key: capacity()[key])
        self.running_requests.set_function(running)
        self.waiting_requests.set_function(waiting)
