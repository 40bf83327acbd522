"""The prefix cache's Prometheus series, read from the cache's own counters at scrape time."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from dsv4.cache.radix import LOAD, WRITE, RadixCache

_DIRECTIONS = {LOAD: "load", WRITE: "write"}


class PrefixCacheCollector:
    """Registered in the engine's registry; series by `tier` ("device", and "host" with the host tier)."""

    def __init__(self, cache: RadixCache):
        self._cache = cache

    def collect(self):
        cache, P = self._cache, self._cache.page_size
        host = cache.host
        hits = CounterMetricFamily("dsv4_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache, "
                                   "by the tier they were found on", labels=["tier"])
        hits.add_metric(["device"], (cache.hit_pages - cache.hit_pages_host) * P)
        evicted = CounterMetricFamily("dsv4_prefix_cache_evicted_pages", "Cached pages evicted (LRU) from a tier "
                                      "to free room (device: moved to the host tier when it has one)",
                                      labels=["tier"])
        evicted.add_metric(["device"], cache.evicted_pages)
        pages = GaugeMetricFamily("dsv4_prefix_cache_pages", "Pages held by the prefix cache, by tier",
                                  labels=["tier"])
        pages.add_metric(["device"], cache.num_nodes)
        if host is not None:
            hits.add_metric(["host"], cache.hit_pages_host * P)
            evicted.add_metric(["host"], cache.evicted_host_pages)
            pages.add_metric(["host"], cache.num_host)
        yield hits
        yield evicted
        yield pages
        yield CounterMetricFamily("dsv4_prefix_cache_inserted_pages", "Pages that joined the prefix cache",
                                  value=cache.inserted_pages)
        yield GaugeMetricFamily("dsv4_prefix_cache_evictable_pages", "Cached device pages no running request shares",
                                value=cache.num_unreferenced)
        if host is None:
            return
        copied = CounterMetricFamily("dsv4_hicache_copy_bytes", "Bytes copied between the device pools and the "
                                     "host tier, by direction", labels=["direction"])
        seconds = HistogramMetricFamily("dsv4_hicache_copy_seconds", "Host-tier copy latency, submission to "
                                        "completion (one node: page and snapshot), by direction",
                                        labels=["direction"])
        for kind, direction in _DIRECTIONS.items():
            copied.add_metric([direction], host.copy_bytes.get(kind, 0))
            latency = host.copy_seconds.get(kind)
            if latency is not None:
                seconds.add_metric([direction], latency.buckets(), latency.total)
        yield copied
        yield seconds
        yield CounterMetricFamily("dsv4_hicache_load_failures", "Host-tier loads that failed their checksum "
                                  "(--verify-transfers) or copy; each failed its requests and dropped the node",
                                  value=cache.load_failures)
        yield CounterMetricFamily("dsv4_hicache_stale_completions", "Host-tier copy completions rejected because "
                                  "the node no longer held the units they named", value=cache.stale_completions)
