"""Prometheus metrics of the router and the workers, named `pdserve:<name>` with vLLM's meanings.

Owns the metric definitions (one registry per process, never the global one, so tests can build
several), the worker's scrape-time collector over engine and role counters, and a tiny HTTP
server for a worker's `/metrics`. The router serves its registry on its HTTP API's `/metrics`.
Must not decide anything: callers observe values; nothing here changes behaviour.

Names and meanings follow vLLM's `vllm:` metrics: time_to_first_token_seconds,
inter_token_latency_seconds, e2e_request_latency_seconds, request_queue_time_seconds,
num_requests_running / num_requests_waiting, kv_cache_usage_perc (a fraction in [0, 1], as vLLM),
prefix_cache_queries / prefix_cache_hits (in tokens), prompt_tokens / generation_tokens,
request_success (by finish_reason); plus pdserve's own: requests_rejected (by reason),
request_retries_total (the router's re-routes, resumes and prefill fallbacks, by hop and
status), auth_failures_total (calls refused for a missing or wrong credential, by service and
reason; in every process's registry), and the
transfer counters kv_blocks_put / kv_blocks_fetched / kv_store_reads (by transport). The
spec-decode counters exist from the start and stay at zero until speculative decoding lands.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                   HistogramMetricFamily)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, start_http_server

from pdserve.security.failures import AuthFailureCollector

__all__ = ["BucketCounts", "HOP_BUCKETS_S", "RouterMetrics", "WorkerCollector", "CONTENT_TYPE_LATEST", "render",
           "serve_worker"]

# Actual over predicted time to first token: where admission's promise holds (<= 1) and by how
# much it misses.
TTFT_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 10.0)
_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                      2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                  0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
# One token's trip from the decode worker's engine to the router: sub-millisecond on one host.
HOP_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                  0.5, 1.0, 2.5)


class BucketCounts:
    """A histogram kept by one thread as plain numbers (no lock, no registry), exposed at scrape
    time: `counts[i]` observations <= `bounds[i]` and not <= the bound before; the last slot is
    +Inf."""

    def __init__(self, bounds: tuple[float, ...] = _ITL_BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = 0
        for b in self.bounds:
            if value <= b:
                break
            i += 1
        self.counts[i] += 1
        self.sum += value

    def snapshot(self) -> dict[str, Any]:
        """Cumulative bucket counts as Prometheus lists them, with the sum."""
        cum, total = [], 0
        for n in self.counts:
            total += n
            cum.append(total)
        return {"bounds": list(self.bounds), "cumulative": cum, "sum": self.sum}


def render(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus' text format."""
    return generate_latest(registry)


class RouterMetrics:
    """The router's request-level metrics (one instance per router process)."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        r.register(AuthFailureCollector())
        label = ["model_name"]
        self.ttft = Histogram("pdserve:time_to_first_token_seconds",
                              "Time from arrival to the first token.", label,
                              buckets=_LATENCY_BUCKETS_S, registry=r).labels(model_name)
        self.itl = Histogram("pdserve:inter_token_latency_seconds",
                             "Time between successive output tokens (per token).", label,
                             buckets=_ITL_BUCKETS_S, registry=r).labels(model_name)
        self.e2e = Histogram("pdserve:e2e_request_latency_seconds",
                             "Time from arrival to the last token.", label,
                             buckets=_LATENCY_BUCKETS_S, registry=r).labels(model_name)
        self.worker_hop = Histogram(
            "pdserve:worker_to_router_seconds",
            "Time from the end of the engine step that made a decode message's first token on "
            "the decode worker to the message's arrival here (worker clock vs router clock: "
            "across hosts it includes their offset).", label, buckets=HOP_BUCKETS_S,
            registry=r).labels(model_name)
        self.migration_stall = Histogram(
            "pdserve:migration_stall_seconds",
            "For a request whose decode moved to another worker with its KV: the gap its "
            "client saw, from the last tokens before the move to the first after.", label,
            buckets=HOP_BUCKETS_S, registry=r).labels(model_name)
        self.kv_event_lag = Histogram(
            "pdserve:kv_event_lag_seconds",
            "Time from a worker seeing a prefix-cache change to the router's index holding it "
            "(worker clock vs router clock: across hosts it includes their offset).", label,
            buckets=HOP_BUCKETS_S, registry=r).labels(model_name)
        self.ttft_over_predicted = Histogram(
            "pdserve:ttft_over_predicted",
            "A request's time to first token over the one admission predicted for it when it "
            "was admitted (1: exact; above 1: admission promised too little).", label,
            buckets=TTFT_RATIO_BUCKETS, registry=r).labels(model_name)
        self.ttft_factor = Gauge(
            "pdserve:ttft_prediction_factor",
            "The correction admission last applied to its predicted time to first token, "
            "measured from what admitted requests waited (1: the raw model).", label,
            registry=r).labels(model_name)
        self.queue_time = Histogram("pdserve:request_queue_time_seconds",
                                    "Time from arrival until a prefill worker took the request.",
                                    label, buckets=_LATENCY_BUCKETS_S, registry=r).labels(model_name)
        self.running = Gauge("pdserve:num_requests_running",
                             "Requests being prefilled or decoded.", label,
                             registry=r).labels(model_name)
        self.waiting = Gauge("pdserve:num_requests_waiting",
                             "Requests admitted and waiting for a prefill worker.", label,
                             registry=r).labels(model_name)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens processed.", label,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Tokens generated.", label,
                                         registry=r).labels(model_name)
        self.prefix_queries = Counter("pdserve:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", label,
                                      registry=r).labels(model_name)
        self.prefix_hits = Counter("pdserve:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.", label,
                                   registry=r).labels(model_name)
        self._success = Counter("pdserve:request_success", "Requests finished, by reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._rejected = Counter("pdserve:requests_rejected",
                                 "Requests refused at the door, by reason (in_flight, "
                                 "tenant_in_flight, tenant_rate, predicted_ttft, "
                                 "shutting_down, not_serving, unauthenticated; past the "
                                 "server's own bounds: connections, calls).",
                                 ["model_name", "reason"], registry=r)
        self._retries = Counter("pdserve:request_retries",
                                "Hops re-routed after a worker refused or failed them, by hop "
                                "(prefill, decode, offload; resume: a decode stream resumed "
                                "on another worker after it broke mid-stream; "
                                "prefill_fallback: prefilled on a decode worker) and gRPC "
                                "status.",
                                ["hop", "code"], registry=r)
        self._deflections = Counter(
            "pdserve:deflections",
            "Requests an offload budget fit, by where the prefill deflection sent them: "
            "decode (prefilled on a decode worker, in bounded chunks) or prefill (the prefill "
            "pool, its estimated time to first token no higher).",
            ["model_name", "choice"], registry=r)
        self.model_name = model_name

    def deflected(self, choice: str) -> None:
        self._deflections.labels(self.model_name, choice).inc()

    def retried(self, hop: str, code: str) -> None:
        self._retries.labels(hop, code).inc()

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()


class WorkerCollector:
    """Reads a worker's counters at scrape time through `read()` (a dict, see `metrics_of`)."""

    def __init__(self, model_name: str, read: Callable[[], dict[str, Any]]) -> None:
        self.model_name = model_name
        self.read = read

    def collect(self):
        s = self.read()
        m = [self.model_name]

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(f"pdserve:{name}", doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float):
            c = CounterMetricFamily(f"pdserve:{name}", doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        total = max(1, s["num_total_blocks"])
        yield gauge("num_requests_running", "Requests in the running batch.", s["num_running"])
        yield gauge("num_requests_waiting", "Requests queued for admission.", s["num_waiting"])
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1).",
                    1.0 - s["num_free_blocks"] / total)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s["prefix_cache_queries_tokens"])
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      s["prefix_cache_hits_tokens"])
        yield counter("kv_blocks_put", "KV blocks written to the store.", s["kv_blocks_put"])
        yield counter("kv_blocks_fetched", "KV blocks read from the store.",
                      s["kv_blocks_fetched"])
        reads = CounterMetricFamily("pdserve:kv_store_reads", "Store object reads, by transport.",
                                    labels=["model_name", "transport"])
        for kind, n in sorted(s.get("reads_by_transport", {}).items()):
            reads.add_metric([self.model_name, kind], n)
        yield reads
        moves = CounterMetricFamily(
            "pdserve:migrations", "Running decodes moved off this worker with their KV, by why "
            "(drain, balance, shutdown) and outcome (copied: every full block in the store; "
            "partial: the next worker recomputes from the first one missing).",
            labels=["model_name", "reason", "outcome"])
        for key, n in sorted(s.get("migrations", {}).items()):
            reason, _, outcome = key.partition("/")
            moves.add_metric([self.model_name, reason, outcome], n)
        yield moves
        yield counter("migration_bytes", "KV bytes put to the store for moved decodes.",
                      s.get("migration_bytes", 0))
        for name, doc in (("spec_decode_num_drafts", "Draft proposals verified."),
                          ("spec_decode_num_draft_tokens", "Draft tokens proposed."),
                          ("spec_decode_num_accepted_tokens", "Draft tokens accepted.")):
            yield counter(name, doc, s.get(name, 0))
        for name, doc in (
                ("progressive_requests", "Requests handed over by progressive KV transfer."),
                ("progressive_anchor_joins", "Progressive requests joined on anchor KV."),
                ("progressive_exact_joins", "Progressive requests whose residual was already in."),
                ("progressive_fallbacks", "Progressive requests recomputed (KV late or lost)."),
                ("anchor_num_drafts", "Verifications of drafts made on anchor KV."),
                ("anchor_num_draft_tokens", "Tokens drafted on anchor KV."),
                ("anchor_num_accepted_tokens", "Tokens drafted on anchor KV and accepted."),
                ("kv_stream_layers_put", "Layer pieces streamed to the store during prefill."),
                ("kv_stream_fallbacks", "Streams given up for a whole-block put (queue full)."),
                ("kv_stream_put_failures", "Streamed puts the store refused.")):
            yield counter(name, doc, s.get(name, 0))
        # Counters end in _total once exposed (prometheus_client appends it to a counter).
        for name, key, doc in (
                ("prompt_tokens_computed", "prompt_tokens_computed",
                 "Prompt tokens computed (not served from a prefix cache or an import)."),
                ("engine_busy_seconds", "busy_seconds", "Seconds the engine spent in steps."),
                ("engine_borrowed_steps", "borrowed_steps",
                 "Steps run on cores lent by the host's idle workers (more threads than this "
                 "worker's own)."),
                ("engine_cores_given_back", "cores_given_back",
                 "Borrowed steps that gave their lent cores back midway, when the lender "
                 "claimed them."),
                ("engine_cores_taken_up", "cores_taken_up",
                 "Steps that took up cores midway, freed by workers that hold no requests or "
                 "yield to this one."),
                ("engine_core_wait_seconds", "core_wait_seconds",
                 "Seconds steps waited for another worker's step on lent cores to end."),
                ("local_prefill_requests", "local_prefill_requests",
                 "Requests prefilled on this worker in the decode role (prefill offload)."),
                ("local_prefill_tokens", "local_prefill_tokens",
                 "Prompt tokens of the requests prefilled on this worker in the decode role.")):
            yield counter(name, doc, s.get(key, 0))
        step = s.get("decode_step_histogram")
        if step is not None:
            h = HistogramMetricFamily("pdserve:decode_step_seconds",
                                      "Seconds of each engine step that decoded (some sequence "
                                      "past its prompt).", labels=["model_name"])
            cum = step["cumulative"]
            h.add_metric(m, [*((str(b), n) for b, n in zip(step["bounds"], cum)),
                             ("+Inf", cum[-1])], step["sum"])
            yield h
        per_pos = CounterMetricFamily(
            "pdserve:spec_decode_num_accepted_tokens_per_pos",
            "Verifications whose draft token at this position was accepted.",
            labels=["model_name", "position"])
        for i, n in enumerate(s.get("spec_decode_num_accepted_tokens_per_pos", [])):
            per_pos.add_metric([self.model_name, str(i)], n)
        yield per_pos
        drafts = s.get("spec_decode_num_drafts", 0)
        yield gauge("spec_decode_mean_acceptance_length",
                    "Tokens emitted per verification step (accepted drafts + 1); 0 before any.",
                    1.0 + s.get("spec_decode_num_accepted_tokens", 0) / drafts if drafts else 0.0)


def serve_worker(collector: WorkerCollector, host: str, port: int):
    """Serves `/metrics` for a worker on host:port (0: a free port); returns (server, port)."""
    registry = CollectorRegistry()
    registry.register(collector)
    registry.register(AuthFailureCollector())
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, server.server_port
