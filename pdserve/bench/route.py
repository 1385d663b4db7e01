"""`pdserve bench route`: prefix-cache hit rate and TTFT per routing policy, on a real trace.

Owns one benchmark run on this machine. For each policy, a fresh embedded cluster
(`LocalCluster`: store master and node, `prefill_workers` prefill workers with `num_blocks` KV
blocks each, one decode worker, a router with that policy) is fed the first `requests` requests
of the Mooncake conversation trace (`route_trace`: lengths and block size scaled down by
`token_scale`, arrivals sped up by `speedup`) as token-id prompts through the router's
`Generate` (max_tokens 1: the answer is the first token, so its latency is TTFT). Every policy
gets the same prompts. With `fresh_cluster` off (`--one-cluster`, for tests) one cluster serves
all policies, each through its own router process and with its own token ids (its own seed), so
no run hits another's cache; all runs still see the same sharing structure.

Per policy: the hit rate of the worker's own prefix cache (prompt tokens reused locally / prompt
tokens), the hit rate including blocks fetched from the shared store, TTFT mean and p90 (from
the trace's arrival time, so waiting in the client counts), requests per worker. Beside them the
ideal: one unbounded prefix cache fed the same prompts (`route_trace.ideal_hit_tokens`), and
KV-aware's own-cache hit rate as a fraction of it (the aim is >= 0.9; reported, never asserted).
Own-cache hits = the router's `cached_prompt_tokens` (local and store) minus the store blocks
the prefill workers fetched in the run (their `kv_blocks_from_store`, from GetStats).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from typing import Any

from pdserve.core.errors import ConfigError as BenchConfigError  # bad setting: names it
from pdserve.output import emit
from pdserve.bench.route_replay import Replay, cpu_s, percentile, worker_stats
from pdserve.bench.route_trace import (
    TRACE_BLOCK_TOKENS, PromptMaker, TraceError, default_trace_path, ideal_hit_tokens,
    load_requests, lru_hit_tokens,
)
from pdserve.router.policy import PREFILL_POLICIES

MiB = 1 << 20


@dataclass(frozen=True)
class RouteBenchSettings:
    trace_path: str = ""  # "" -> ../shared/traces/mooncake_conversation_trace.jsonl
    requests: int = 600
    token_scale: int = 32  # a 512-token trace block becomes 16 tokens
    speedup: float = 3.0  # trace seconds per replay second
    policies: tuple[str, ...] = PREFILL_POLICIES
    prefill_workers: int = 2
    # KV blocks per worker, bounded so that routing matters: for the first 600 requests one
    # 4096-block LRU cache gets about half the ideal hit rate, one of 8192 about 94%.
    num_blocks: int = 4096
    block_size_tokens: int = 16
    model_path: str = ""  # "" -> a small random Llama built for the run (route_model)
    # None: room for every run's blocks with 25% to spare, so the store never evicts and no
    # run pays for an earlier run's objects (runs share one store; each has its own tokens).
    store_capacity_bytes: int | None = None
    max_prompt_tokens: int = 4096
    max_in_flight: int = 64  # client threads; requests past them wait in the client (and count)
    request_timeout_s: float = 300.0
    # True: a fresh cluster per policy (same prompts; no run sees another's store or journal:
    # the master's snapshots grow with its objects). False: one cluster, a router per policy,
    # each run its own token ids: faster (tests), but later runs meet a fuller store.
    fresh_cluster: bool = True
    kv_fetch_weight: float | None = None  # None: the router's default (kv_aware's store term)
    kv_request_cost_tokens: float | None = None  # None: the router's default (load per request)

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise BenchConfigError(f"requests must be >= 1, got {self.requests}")
        if self.token_scale < 1 or TRACE_BLOCK_TOKENS % self.token_scale:
            raise BenchConfigError(f"token_scale must divide {TRACE_BLOCK_TOKENS}, "
                                   f"got {self.token_scale}")
        if (TRACE_BLOCK_TOKENS // self.token_scale) % self.block_size_tokens:
            raise BenchConfigError(
                f"block_size_tokens ({self.block_size_tokens}) must divide the scaled trace "
                f"block ({TRACE_BLOCK_TOKENS // self.token_scale}), or shared prefixes split")
        if self.speedup <= 0:
            raise BenchConfigError(f"speedup must be > 0, got {self.speedup}")
        bad = [p for p in self.policies if p not in PREFILL_POLICIES]
        if not self.policies or bad:
            raise BenchConfigError(f"policies must be among {PREFILL_POLICIES}, got {bad or '()'}")
        if self.prefill_workers < 2:
            raise BenchConfigError("prefill_workers must be >= 2 (routing needs a choice)")
        if self.kv_request_cost_tokens is not None and self.kv_request_cost_tokens < 0:
            raise BenchConfigError("kv_request_cost_tokens must be >= 0, got "
                                   f"{self.kv_request_cost_tokens}")
        if self.kv_fetch_weight is not None and self.kv_fetch_weight < 0:
            raise BenchConfigError(f"kv_fetch_weight must be >= 0, got {self.kv_fetch_weight}")
        if self.num_blocks * self.block_size_tokens <= self.max_prompt_tokens:
            raise BenchConfigError("num_blocks x block_size_tokens must exceed max_prompt_tokens")


QUICK = RouteBenchSettings(requests=200, num_blocks=1024, speedup=4.0)


def run_policy(cluster, policy: str, seed: int, s: RouteBenchSettings, reqs,
               on_done=None) -> tuple[dict[str, Any], list[list[int]]]:
    """One policy's replay (the cluster's own router if it routes by `policy`, else a new
    router over its workers); its figures and the prompts it sent."""
    maker = PromptMaker(s.token_scale, seed, s.max_prompt_tokens)
    prompts = [maker.prompt(r) for r in reqs]
    arrivals = [r.arrival_s / s.speedup for r in reqs]
    prefill = cluster.worker_addresses("prefill")
    own = cluster.spec.routing == policy
    address = cluster.router_address if own else \
        cluster.add_router(f"router-{policy}", _free_port(), policy)
    router_name = "router" if own else f"router-{policy}"
    try:
        load_start = os.getloadavg()[0]
        before, cpu_before = worker_stats(prefill), cpu_s(cluster)
        replay = Replay(address, prompts, arrivals, s.max_in_flight, s.request_timeout_s, on_done)
        wall_s = replay.run()
        after, cpu_after = worker_stats(prefill), cpu_s(cluster)
    finally:
        if not own:
            cluster.stop_child(address)
    prompt_tokens = sum(len(p) for p in prompts)
    cached = sum(replay.cached)
    store_tokens = s.block_size_tokens * sum(
        a.kv_blocks_from_store - b.kv_blocks_from_store for a, b in zip(after, before))
    local = max(0, cached - store_tokens)
    ttfts = [t for t in replay.ttft_s if t is not None]
    return {
        "policy": policy, "seed": seed, "requests": len(prompts),
        "errors": len(replay.errors), "error_examples": replay.errors[:3],
        "prompt_tokens": prompt_tokens, "cached_tokens": cached, "store_tokens": store_tokens,
        "local_hit_tokens": local, "local_hit_rate": local / prompt_tokens,
        "total_hit_rate": cached / prompt_tokens,
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "ttft_p50_s": percentile(ttfts, 0.5) if ttfts else None,
        "ttft_p90_s": percentile(ttfts, 0.9) if ttfts else None,
        "wall_s": wall_s,
        # The machine is shared: the 1-minute load average when the replay started and ended.
        "loadavg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        # Where the machine's time went: CPU seconds per process during the replay.
        "cpu_s": {("router" if k == router_name else k): round(v - cpu_before.get(k, 0.0), 2)
                  for k, v in cpu_after.items()
                  if k in cpu_before and (k == router_name or not k.startswith("router"))},
        "requests_per_worker": [a.requests_finished - b.requests_finished
                                for a, b in zip(after, before)],
    }, prompts


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _store_bytes(s: RouteBenchSettings, reqs, mc) -> int:
    """Store room for every block of every run on it (fp32 KV), plus 25% and 64 MiB."""
    block_bytes = mc.num_hidden_layers * 2 * s.block_size_tokens * mc.num_key_value_heads \
        * mc.head_dim * 4
    blocks = sum(min(s.max_prompt_tokens, -(-r.input_length // s.token_scale))
                 // s.block_size_tokens for r in reqs)
    runs = 1 if s.fresh_cluster else len(s.policies)
    return int(1.25 * runs * blocks * block_bytes) + 64 * MiB


def _trace_ideal(reqs) -> float:
    """Ideal hit rate on the trace's own blocks (hash ids), as `bench kvstore` reports it."""
    seen: set[int] = set()
    hits = total = 0
    for r in reqs:
        n = 0
        while n < len(r.hash_ids) and r.hash_ids[n] in seen:
            n += 1
        hits, total = hits + n, total + len(r.hash_ids)
        seen.update(r.hash_ids)
    return hits / total if total else 0.0


def measure(s: RouteBenchSettings, progress: bool = True) -> dict[str, Any]:
    from pdserve.bench.route_model import build_bench_model
    from pdserve.launcher.local import ClusterSpec, LocalCluster
    from pdserve.engine.loader import load_model_config

    trace = s.trace_path or default_trace_path()
    reqs = load_requests(trace, s.requests)
    started = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="pdserve-bench-route-")
    rows: dict[str, Any] = {}
    ideal = (0, 0)
    capacity = s.store_capacity_bytes
    lru: dict[int, int] = {}
    try:
        with _Progress(progress) as bar:
            bar.note("building the bench model" if not s.model_path else "")
            model = s.model_path or build_bench_model(os.path.join(tmp, "bench-llama"))
            capacity = s.store_capacity_bytes or _store_bytes(s, reqs, load_model_config(model))
            bar.note(f"cluster: store of {capacity / MiB:,.0f} MiB, {s.prefill_workers} prefill "
                     f"workers x {s.num_blocks} KV blocks, 1 decode worker; "
                     + ("a fresh one per policy" if s.fresh_cluster else "one for all policies"))

            router_settings = {k: v for k, v in (
                ("kv_fetch_weight", s.kv_fetch_weight),
                ("kv_request_cost_tokens", s.kv_request_cost_tokens)) if v is not None}

            def spec(routing: str, k: int) -> ClusterSpec:
                return ClusterSpec(
                    model_path=model, router_port=_free_port(), store_port=_free_port(),
                    worker_ports=tuple(_free_port() for _ in range(s.prefill_workers + 1)),
                    prefill_workers=s.prefill_workers, decode_workers=1, num_blocks=s.num_blocks,
                    block_size_tokens=s.block_size_tokens, store_capacity_bytes=capacity,
                    routing=routing, http_port=None, log_dir=os.path.join(tmp, f"logs{k}"),
                    router_settings=router_settings, controller=False,  # routing alone is measured
                    # ... of every prompt: none skips the prefill pool for the decode worker
                    max_local_prefill_tokens=0,
                    max_predicted_ttft_s=0.0)  # open loop: every request measured, none refused

            with ExitStack() as stack:
                shared = None if s.fresh_cluster else \
                    stack.enter_context(LocalCluster(spec(s.policies[0], 0)))
                for k, policy in enumerate(s.policies):
                    task = bar.task(f"{policy:<13}", len(reqs))
                    with ExitStack() as per_policy:
                        cluster = shared or per_policy.enter_context(
                            LocalCluster(spec(policy, k)))
                        rows[policy], prompts = run_policy(
                            cluster, policy, k if shared else 0, s, reqs,
                            on_done=lambda t=task: bar.step(t))
                    if k == 0:
                        ideal = ideal_hit_tokens(prompts, s.block_size_tokens)
                        lru = {n: lru_hit_tokens(prompts, s.block_size_tokens, n * s.num_blocks)
                               for n in (1, s.prefill_workers)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summarize(replace(s, store_capacity_bytes=capacity), trace, reqs, rows, ideal, lru,
                     model_desc=s.model_path or "bench-llama (random, hidden 256, 4 layers, "
                     "SmolLM2 tokenizer)", wall_s=time.perf_counter() - started)


def summarize(s: RouteBenchSettings, trace: str, reqs, rows: dict[str, Any],
              ideal: tuple[int, int], lru: dict[int, int], model_desc: str,
              wall_s: float) -> dict[str, Any]:
    ideal_rate = ideal[0] / ideal[1] if ideal[1] else 0.0
    base = rows.get("round_robin")
    for r in rows.values():
        r["local_vs_ideal"] = r["local_hit_rate"] / ideal_rate if ideal_rate else None
        r["ttft_mean_vs_round_robin"] = (
            r["ttft_mean_s"] / base["ttft_mean_s"]
            if base and base["ttft_mean_s"] and r["ttft_mean_s"] else None)
    kv = rows.get("kv_aware")
    ratio = kv["local_vs_ideal"] if kv else None
    settings = asdict(s)
    settings["trace_path"] = trace
    return {
        "bench": "route",
        "settings": settings,
        "scale": {"token_scale": s.token_scale,
                  "trace_block_tokens": TRACE_BLOCK_TOKENS,
                  "scaled_block_tokens": TRACE_BLOCK_TOKENS // s.token_scale,
                  "speedup": s.speedup,
                  "statement": f"prompt lengths / {s.token_scale} (512-token trace blocks -> "
                               f"{TRACE_BLOCK_TOKENS // s.token_scale} tokens), arrival times "
                               f"/ {s.speedup:g}"},
        "trace": {"path": trace, "requests": len(reqs),
                  "span_s": reqs[-1].arrival_s if reqs else 0.0,
                  "attribution": "Mooncake (FAST '25) release traces, conversation workload, "
                                 "Apache-2.0",
                  "ideal_block_hit_rate": _trace_ideal(reqs)},
        "model": model_desc,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "ideal": {"hit_tokens": ideal[0], "prompt_tokens": ideal[1], "hit_rate": ideal_rate,
                  # What the bound costs: one exact-LRU cache of one worker's blocks, and of all
                  # prefill workers' blocks together (what perfect partitioning could reach).
                  "lru_hit_rate_by_capacity_blocks": {
                      str(n * s.num_blocks): h / ideal[1] if ideal[1] else 0.0
                      for n, h in lru.items()}},
        "policies": rows,
        "aim": {"kv_aware_local_vs_ideal_min": 0.9, "kv_aware_local_vs_ideal": ratio,
                "met": None if ratio is None else ratio >= 0.9},
        "wall_s": wall_s,
    }


class _Progress:
    """Rich progress bars on stderr (one per policy), or nothing."""

    def __init__(self, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
            )

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=Console(stderr=True))

    def __enter__(self) -> "_Progress":
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def note(self, text: str) -> None:
        if self._bar is not None and text:
            self._bar.console.print(text)

    def task(self, description: str, total: int) -> Any:
        return self._bar.add_task(description, total=total) if self._bar else None

    def step(self, task: Any) -> None:
        if self._bar is not None:
            self._bar.advance(task)  # thread-safe: replay threads call it


# ---- CLI ----------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = RouteBenchSettings()
    parser.add_argument("--trace", metavar="PATH", default=None,
                        help="Mooncake-format JSONL trace (default "
                             "../shared/traces/mooncake_conversation_trace.jsonl)")
    parser.add_argument("--requests", type=int, default=None,
                        help=f"replay the first N requests (default {d.requests}; "
                             f"--quick {QUICK.requests})")
    parser.add_argument("--token-scale", type=int, default=None,
                        help=f"prompt lengths / this (default {d.token_scale}: 512-token trace "
                             f"blocks become {TRACE_BLOCK_TOKENS // d.token_scale} tokens)")
    parser.add_argument("--speedup", type=float, default=None,
                        help=f"arrival times / this (default {d.speedup:g})")
    parser.add_argument("--policies", default=None,
                        help=f"comma-separated, from {','.join(PREFILL_POLICIES)} (default all)")
    parser.add_argument("--prefill-workers", type=int, default=None,
                        help=f"default {d.prefill_workers}")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help=f"KV blocks per worker (default {d.num_blocks})")
    parser.add_argument("--kv-fetch-weight", type=float, default=None,
                        help="kv_aware: cost of a store fetch relative to computing a block "
                             "(default: the router's, 0.2)")
    parser.add_argument("--kv-request-cost-tokens", type=float, default=None,
                        help="kv_aware: queue load per request in flight, in prompt tokens "
                             "(default: the router's, 64)")
    parser.add_argument("--model", default=None,
                        help="model path (default: a small random Llama built for the run)")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.add_argument("--out", metavar="DIR",
                        help="also write DIR/route.json and DIR/route.png")
    parser.add_argument("--quick", action="store_true",
                        help=f"short run: {QUICK.requests} requests, {QUICK.num_blocks} blocks "
                             f"per worker, speedup {QUICK.speedup:g} (explicit flags still win)")
    parser.add_argument("--one-cluster", action="store_true",
                        help="one cluster for all policies (a router each, own token ids): "
                             "faster, but later runs meet a fuller store")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return parser


def settings_from_args(args: argparse.Namespace) -> RouteBenchSettings:
    base = QUICK if args.quick else RouteBenchSettings()
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip()) \
        if args.policies else None
    given = {"trace_path": args.trace, "requests": args.requests,
             "token_scale": args.token_scale, "speedup": args.speedup, "policies": policies,
             "prefill_workers": args.prefill_workers, "num_blocks": args.num_blocks,
             "model_path": args.model, "kv_fetch_weight": args.kv_fetch_weight,
             "kv_request_cost_tokens": args.kv_request_cost_tokens}
    return replace(base, fresh_cluster=not args.one_cluster,
                   **{k: v for k, v in given.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.route_report import print_tables, write_outputs

    try:
        result = measure(settings_from_args(args), progress=not args.no_progress)
    except (BenchConfigError, TraceError) as e:
        print(f"pdserve bench route: {e}", file=sys.stderr)
        return 2
    return emit(result, json_out=args.json, out_dir=args.out, write_outputs=write_outputs,
                print_tables=print_tables)


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(
        prog="pdserve bench route", description=__doc__.split("\n", 1)[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
