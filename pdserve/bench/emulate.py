"""`pdserve bench emulate`: the control plane of emulated clusters of N workers, against N.

For each N: start an emulated cluster (`pdserve emulate`'s: store, router, controller in
advisory mode, N workers of which a quarter prefill, supervised) and measure, with the real
processes:
- start-up: seconds until every process serves; memory (RSS) per process kind;
- CPU per process kind over an idle window and under a steady load of streamed requests
  (the clients check every token against the emulated model's);
- the controller's tick by part (observe, decide, whole) and the router's KV event lag, from
  their own histograms; the store master's calls per second and their p99 handler time over
  the load window, from the master's own counts (its Stats answer);
- a rebalance under load (a sixteenth of the workers flipped at once): its wall time;
- membership after kill -9 of a tenth of the decode workers at once: seconds until the router
  holds every one of them out of its pools, and until all serve again after supervision
  restarts them.
Must not assert anything: it reports (`bench/emulate_report.py` makes the tables and PNG).
"""

from __future__ import annotations

import math
import os
import platform
import threading
import time
from typing import Any

from pdserve.bench.chaos_client import RequestSpec, StreamClient, workload

PHASES = ("start", "idle", "load", "flip", "kill")


def add_arguments(p):
    p.add_argument("--workers", default="16,64", help="cluster sizes, comma-separated")
    p.add_argument("--profile", default="h100-llama3-8b", help="the step-time profile")
    p.add_argument("--kv-scale", type=float, default=1 / 64)
    p.add_argument("--rate", type=float, default=4.0, help="requests per second under load")
    p.add_argument("--load-s", type=float, default=20.0, help="seconds of steady load")
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--out", default=None, help="write emulate.json and emulate.png here")
    p.add_argument("--model", default="", help="vocabulary and shape (default: SmolLM2-135M)")
    return p


# ---- process figures -----------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def _kind(name: str) -> str:
    for k in ("prefill", "decode", "router", "controller", "kvmaster", "kvnode"):
        if name.startswith(k):
            return "worker" if k in ("prefill", "decode") else k
    return name


def _cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def _rss_pss_mb(pid: int) -> tuple[float, float]:
    """(RSS, PSS) in MB: resident pages, and the process's share of them (a library's pages
    mapped by k processes count 1/k each: what one more process adds to the machine)."""
    out = {"Rss:": 0.0, "Pss:": 0.0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key = line.split(maxsplit=1)[0]
                if key in out:
                    out[key] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out["Rss:"], out["Pss:"]


def _pids(cluster) -> dict[str, int]:
    return {c.name: c.proc.pid for c in cluster.children if c.proc.poll() is None}


def cpu_window(cluster, seconds: float) -> dict[str, dict[str, float]]:
    """CPU seconds per second of wall time, per process kind (mean and max per process)."""
    before = {n: _cpu_s(p) for n, p in _pids(cluster).items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    per: dict[str, list[float]] = {}
    for n, p in _pids(cluster).items():
        if n in before:
            per.setdefault(_kind(n), []).append((_cpu_s(p) - before[n]) / wall)
    return {k: {"processes": len(v), "mean": round(sum(v) / len(v), 4),
                "max": round(max(v), 4), "sum": round(sum(v), 3)} for k, v in sorted(per.items())}


def memory(cluster) -> dict[str, dict[str, float]]:
    """Per process kind: RSS mean and max, and PSS mean and sum (the machine's share)."""
    per: dict[str, list[tuple[float, float]]] = {}
    for n, p in _pids(cluster).items():
        per.setdefault(_kind(n), []).append(_rss_pss_mb(p))
    return {k: {"processes": len(v), "mean_mb": round(sum(r for r, _ in v) / len(v), 1),
                "max_mb": round(max(r for r, _ in v), 1),
                "pss_mean_mb": round(sum(q for _, q in v) / len(v), 1),
                "pss_sum_mb": round(sum(q for _, q in v), 1)}
            for k, v in sorted(per.items())}


# ---- histograms from /metrics --------------------------------------------------------------
def histogram(url: str, name: str, labels: str = "") -> dict[str, float] | None:
    """p50, p99 (bucket upper bounds) and count of histogram `name` (with `labels`, e.g.
    'part="decide"') from a Prometheus text page."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    buckets: list[tuple[float, float]] = []
    count = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{") and labels in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((math.inf if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
        elif line.startswith(f"{name}_count") and labels in line:
            count = float(line.rsplit(" ", 1)[1])
    if not count:
        return None
    buckets.sort()
    return {"p50_le": _bound(buckets, 0.5), "p99_le": _bound(buckets, 0.99), "count": count}


def _bound(buckets: list[tuple[float, float]], frac: float) -> float | None:
    """The smallest bucket bound holding `frac` of the observations ((bound, cumulative
    count) pairs in order, the last the total); None without any."""
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    return next((le for le, c in buckets if c >= frac * total), math.inf)


def master_calls(address: str) -> dict[str, dict[str, Any]]:
    """The store master's counts now: per method, calls and the cumulative histogram."""
    from pdserve import rpc
    from pdserve.core.identity import MASTER
    from pdserve.proto import kvmaster_pb2 as pb
    from pdserve.proto import kvmaster_pb2_grpc as pb_grpc

    with rpc.make_channel(address, MASTER) as ch:
        stats = pb_grpc.KVMasterStub(ch).Stats(pb.MasterStatsRequest(), timeout=30)
    return {m.method: {"calls": m.calls, "bounds": list(m.bounds_s),
                       "cumulative": list(m.cumulative)} for m in stats.methods}


def master_window(before: dict, after: dict, seconds: float) -> dict[str, Any]:
    """Calls per second and the p99 handler time (a bucket bound) between two counts, per
    method and over all of them."""
    per, total_cum, bounds = {}, None, []
    for m, a in sorted(after.items()):
        b = before.get(m, {"cumulative": [0] * len(a["cumulative"])})
        cum = [x - y for x, y in zip(a["cumulative"], b["cumulative"])]
        if not cum[-1]:
            continue
        bounds = a["bounds"]
        per[m] = {"per_s": round(cum[-1] / seconds, 1),
                  "p99_le": _bound(list(zip([*bounds, math.inf], cum)), 0.99)}
        total_cum = cum if total_cum is None else [x + y for x, y in zip(total_cum, cum)]
    return {"per_s": round((total_cum[-1] if total_cum else 0) / seconds, 1),
            "p99_le": _bound(list(zip([*bounds, math.inf], total_cum or [])), 0.99),
            "methods": per}


# ---- load ----------------------------------------------------------------------------------
class Load(threading.Thread):
    """Streams `rate` requests per second until stopped; each client checks its tokens."""

    def __init__(self, router: str, specs: list[RequestSpec], rate: float) -> None:
        super().__init__(daemon=True)
        self.router, self.specs, self.rate = router, specs, rate
        self.clients: list[StreamClient] = []
        self.stop = threading.Event()

    def run(self) -> None:
        for i, s in enumerate(self.specs):
            if self.stop.wait(1 / self.rate if i else 0):
                return
            c = StreamClient(self.router, s, time.monotonic() + 300)
            c.start()
            self.clients.append(c)

    def finish(self, expected) -> dict[str, Any]:
        self.stop.set()
        self.join()
        for c in self.clients:
            c.join(timeout=300)
        ok = sum(1 for c in self.clients if c.error is None and c.ids == expected(c.spec))
        return {"requests": len(self.clients), "correct": ok,
                "errors": sorted({c.error for c in self.clients if c.error})[:3]}


def _expected(config):
    from pdserve.engine.emulated import token_of

    eos = frozenset(config.eos_token_ids)

    def tokens(s: RequestSpec) -> list[int]:
        return [token_of(s.request_id, i, s.seed if s.temperature > 0 else None,
                         config.vocab_size, eos) for i in range(s.max_tokens)]
    return tokens


# ---- membership ----------------------------------------------------------------------------
def _members(cluster) -> dict[str, int]:
    from pdserve import rpc
    from pdserve.core.identity import ROUTER
    from pdserve.proto import router_pb2 as rpb
    from pdserve.proto import router_pb2_grpc as rpb_grpc

    with rpc.make_channel(cluster.router_control_address, ROUTER) as ch:
        r = rpb_grpc.RouterControlStub(ch).ListWorkers(rpb.ListWorkersRequest(), timeout=10)
    return {w.address: w.state for w in r.workers}


def kill_tenth(cluster, timeout_s: float = 120.0) -> dict[str, Any]:
    """kill -9 a tenth of the decode workers at once. Seconds until the router held every one
    out of its pools (None: a replacement registered before it noticed), until supervision
    had restarted every one, and until every replacement was back in the pools."""
    from pdserve.proto import router_pb2 as rpb

    decode = [c for c in cluster.children if c.name.startswith("decode-")]
    victims = decode[:max(1, len(decode) // 10)]
    names = {c.name: c.proc.pid for c in victims}
    addresses = {c.address for c in victims}
    t0 = time.monotonic()
    for c in victims:
        c.proc.kill()
    out_s = restarted_s = back_s = None
    while time.monotonic() - t0 < timeout_s:
        states = _members(cluster)
        now = time.monotonic() - t0
        if out_s is None and all(states.get(a) != rpb.MEMBER_STATE_ACTIVE for a in addresses):
            out_s = now
        live = {c.name: c.proc for c in cluster.children if c.name in names}
        if restarted_s is None and all(p.pid != names[n] and p.poll() is None
                                       for n, p in live.items()):
            restarted_s = now
        if restarted_s is not None and all(states.get(a) == rpb.MEMBER_STATE_ACTIVE
                                           for a in addresses):
            back_s = now
            break
        time.sleep(0.1)
    return {"killed": len(victims), "out_of_pools_s": _r(out_s),
            "restarted_s": _r(restarted_s), "back_in_pools_s": _r(back_s)}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def rebalance(cluster, prefill: int, decode: int) -> dict[str, Any]:
    """The controller's rebalance to prefill:decode, as an operator asks it: wall time."""
    from pdserve import rpc
    from pdserve.core.identity import CONTROLLER
    from pdserve.proto import controller_pb2 as cpb
    from pdserve.proto import controller_pb2_grpc as cpb_grpc

    t0 = time.monotonic()
    with rpc.make_channel(cluster.controller_address, CONTROLLER) as ch:
        r = cpb_grpc.ControllerStub(ch).Rebalance(
            cpb.RebalanceRequest(prefill=prefill, decode=decode, drain_timeout_s=60),
            timeout=600)
    return {"to": f"{prefill}:{decode}", "seconds": round(time.monotonic() - t0, 2),
            "flips": len(r.results), "ok": sum(1 for f in r.results if f.ok),
            "flip_s_max": round(max((f.seconds for f in r.results), default=0.0), 2)}


# ---- one size ------------------------------------------------------------------------------
def measure(model: str, n: int, args, config, progress=lambda phase: None) -> dict[str, Any]:
    from pdserve.launcher.cluster_spec import emulated_pools, free_ports
    from pdserve.launcher.local import ClusterSpec, LocalCluster

    k, d = emulated_pools(n, None)
    spec = ClusterSpec(model_path=model, prefill_workers=k, decode_workers=d,
                       router_port=free_ports(1)[0], http_port=0, supervise=True,
                       controller=True, controller_mode="advisory", engine="emulated",
                       profile=args.profile, kv_scale=args.kv_scale,
                       ready_timeout_s=max(180.0, 3.0 * n))
    out: dict[str, Any] = {"workers": n, "prefill": k, "decode": d}
    progress("start")
    t0 = time.monotonic()
    with LocalCluster(spec) as cluster:
        out["start_s"] = round(time.monotonic() - t0, 1)
        out["memory"] = memory(cluster)
        progress("idle")
        out["cpu_idle"] = cpu_window(cluster, args.idle_s)
        progress("load")
        specs = workload(int(args.rate * (args.load_s + 60)), args.prompt_tokens,
                         args.max_tokens, config.vocab_size, seed=n, ids=f"n{n}-")
        load = Load(cluster.router_address, specs, args.rate)
        load.start()
        time.sleep(min(5.0, args.load_s / 4))  # into the steady state
        before, t_before = master_calls(cluster.store_address), time.monotonic()
        out["cpu_load"] = cpu_window(cluster, args.load_s)
        out["master_calls"] = master_window(before, master_calls(cluster.store_address),
                                            time.monotonic() - t_before)
        progress("flip")
        step = max(1, n // 16)
        out["rebalance"] = rebalance(cluster, k + step, d - step)
        out["load"] = load.finish(_expected(config))
        out["controller_tick"] = {part: histogram(cluster.controller_metrics,
                                                  "pdserve:controller_tick_seconds",
                                                  f'part="{part}"')
                                  for part in ("observe", "decide", "whole")}
        out["kv_event_lag"] = histogram(f"http://{cluster.http_address}/metrics",
                                        "pdserve:kv_event_lag_seconds")
        progress("kill")
        out["kill_tenth"] = kill_tenth(cluster)
    return out


def run_bench(model: str, sizes: list[int], args, progress=lambda n, phase: None) -> dict:
    from pdserve.engine.checkpoint_config import load_model_config

    config = load_model_config(model)
    started = time.monotonic()
    results = [measure(model, n, args, config, lambda phase, n=n: progress(n, phase))
               for n in sizes]
    return {"bench": "emulate", "model": os.path.basename(model), "profile": args.profile,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "settings": {"kv_scale": args.kv_scale, "rate_rps": args.rate, "load_s": args.load_s,
                         "idle_s": args.idle_s, "prompt_tokens": args.prompt_tokens,
                         "max_tokens": args.max_tokens},
            "sizes": results, "seconds": round(time.monotonic() - started, 1)}


def run(args) -> int:
    from rich.progress import Progress

    from pdserve.bench import emulate_report
    from pdserve.output import emit

    try:
        sizes = [int(x) for x in args.workers.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--workers: comma-separated integers, got {args.workers!r}") from None
    if not sizes or min(sizes) < 4:
        raise SystemExit("--workers: each size must be >= 4")
    model = args.model
    if not model:
        from pdserve.engine.model_files import default_model_path
        model = default_model_path()
    with Progress(transient=True, disable=args.json) as bar:
        task = bar.add_task("starting", total=len(sizes) * len(PHASES))

        def progress(n: int, phase: str) -> None:
            bar.update(task, advance=1, description=f"{n} workers: {phase}")
        result = run_bench(model, sizes, args, progress)
    return emit(result, json_out=args.json, out_dir=args.out,
                write_outputs=emulate_report.write_outputs,
                print_tables=emulate_report.print_tables)
