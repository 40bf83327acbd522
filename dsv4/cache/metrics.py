"""The prefix cache's Prometheus series, read from the cache's own counters at scrape time."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dsv4.cache.radix import RadixCache


class PrefixCacheCollector:
    """Registered in the engine's registry; `tier` is "device" (the host tier has its own rows)."""

    def __init__(self, cache: RadixCache):
        self._cache = cache

    def collect(self):
        cache = self._cache
        hits = CounterMetricFamily("dsv4_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache, "
                                   "by tier", labels=["tier"])
        hits.add_metric(["device"], cache.hit_pages * cache.page_size)
        yield hits
        yield CounterMetricFamily("dsv4_prefix_cache_evicted_pages", "Cached pages evicted (LRU) to free room",
                                  value=cache.evicted_pages)
        yield CounterMetricFamily("dsv4_prefix_cache_inserted_pages", "Pages that joined the prefix cache",
                                  value=cache.inserted_pages)
        yield GaugeMetricFamily("dsv4_prefix_cache_pages", "Pages held by the prefix cache", value=cache.num_nodes)
        yield GaugeMetricFamily("dsv4_prefix_cache_evictable_pages", "Cached pages no running request shares",
                                value=cache.num_unreferenced)
