"""The worker's store-health metrics, next to the common worker collector (`pdserve.metrics`).

Owns `pdserve:store_degraded` (gauge: 1 while the KV store cannot serve this worker),
`pdserve:store_errors_total{op}` (failed store calls per operation) and
`pdserve:kv_recomputed_requests_total` (decode requests whose prompt KV was recomputed here
because the store could not give it), read at scrape time from the worker's metrics snapshot,
and `WorkerCollectors`, which serves several collectors as one. Must not keep state of its own.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.worker.store_health import OPERATIONS


class StoreHealthCollector:
    def __init__(self, model_name: str, read: Callable[[], dict[str, Any]]) -> None:
        self.model_name = model_name
        self.read = read

    def collect(self):
        s = self.read()
        m = [self.model_name]
        degraded = GaugeMetricFamily(
            "pdserve:store_degraded",
            "1 while the KV store cannot serve this worker (requests are served by "
            "recomputation), else 0.", labels=["model_name"])
        degraded.add_metric(m, 1.0 if s.get("store_degraded") else 0.0)
        yield degraded
        errors = CounterMetricFamily("pdserve:store_errors", "Store calls that failed, by "
                                     "operation.", labels=["model_name", "op"])
        counts = s.get("store_errors", {})
        for op in OPERATIONS:  # every label from the start, so rates work from zero
            errors.add_metric([self.model_name, op], counts.get(op, 0))
        yield errors
        recomputed = CounterMetricFamily(
            "pdserve:kv_recomputed_requests",
            "Decode requests whose prompt KV was recomputed here because the store could not "
            "give it.", labels=["model_name"])
        recomputed.add_metric(m, s.get("kv_recomputed_requests", 0))
        yield recomputed


class WorkerCollectors:
    """Several collectors registered as one (`pdserve.metrics.serve_worker` takes one)."""

    def __init__(self, *collectors) -> None:
        self.collectors = collectors

    def collect(self):
        for c in self.collectors:
            yield from c.collect()
