"""``GET /metrics``: Prometheus text from ``prometheus-client``, one registry per server.

Counters and histograms are updated once per finished turn; the pool's and the
sessions' gauges are read when scraped, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from clm_middleware.cache.block_pool import PoolStats
from clm_middleware.lifecycle.turn import TurnStats, token_totals

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _Live(Collector):
    def __init__(self, pool_stats: Callable[[], PoolStats], sessions: Callable[[], int]) -> None:
        self._pool_stats = pool_stats
        self._sessions = sessions

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._pool_stats()
        gauges = [
            ("clm_pool_blocks_in_use", "KV blocks held by conversations or requests", stats.blocks_in_use),
            (
                "clm_pool_blocks_free",
                "KV blocks never written or freed (no key; cached-free not included)",
                stats.blocks_free,
            ),
            (
                "clm_pool_blocks_cached_free",
                "free blocks still holding a prefix",
                stats.blocks_cached_free,
            ),
            ("clm_pool_blocks_total", "KV blocks the pool holds", stats.num_blocks),
            ("clm_sessions", "open managed conversations", self._sessions()),
        ]
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value)
        yield CounterMetricFamily("clm_pool_evictions", "cached blocks evicted for new ones", stats.evictions)


class ServerMetrics:
    def __init__(self, pool_stats: Callable[[], PoolStats], sessions: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter("clm_requests", "HTTP requests answered", ["endpoint", "status"], registry=registry)
        self.prompt_tokens = Counter("clm_prompt_tokens", "prompt tokens of finished turns", registry=registry)
        self.cached_tokens = Counter("clm_cached_tokens", "prompt tokens served from the KV pool", registry=registry)
        self.prefill_tokens = Counter("clm_prefill_tokens", "prompt tokens computed", registry=registry)
        self.generated_tokens = Counter("clm_generated_tokens", "tokens generated", registry=registry)
        self.compactions = Counter("clm_compactions", "turns that compacted", ["reason"], registry=registry)
        self.turn_seconds = Histogram(
            "clm_turn_seconds", "wall time of one turn", buckets=_LATENCY_BUCKETS, registry=self.registry
        )
        self.ttft_seconds = Histogram(
            "clm_ttft_seconds", "time to the first token", buckets=_LATENCY_BUCKETS, registry=self.registry
        )
        self.waiting_for_pool = Gauge(
            "clm_requests_waiting_for_pool",
            "requests the KV pool has no room for, waiting in line for running turns (--pool-wait)",
            registry=registry,
        )
        self.registry.register(_Live(pool_stats, sessions))

    def turn(self, stats: TurnStats) -> None:
        """A turn's tokens, with what it computed ahead for the next turn (``--compact-ahead``)."""
        prompt, cached, prefill = token_totals([stats])
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.prefill_tokens.inc(prefill)
        self.generated_tokens.inc(stats.generated_tokens)
        if stats.compaction:
            self.compactions.labels(reason=stats.compaction).inc()
        self.turn_seconds.observe(stats.turn_s)
        self.ttft_seconds.observe(stats.ttft_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
