"""What `pdserve bench serve` reads from running processes: metrics, CPU time and memory.

Owns one scrape of a cluster (`scrape`: the router's and every worker's Prometheus /metrics as
sample totals, with each worker's role now and its decode-step counters from GetStats, which
/metrics does not carry), the difference of two scrapes, the CPU seconds of named process trees
and of the bench's own process (its client), and the resident memory of a process tree. Must
not change anything in the processes it reads.
"""

from __future__ import annotations

import time
import urllib.request
from typing import Any


def get_text(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read().decode("utf-8")


def _stats(address: str) -> dict[str, float] | None:
    import grpc

    from pdserve import rpc
    from pdserve.proto import worker_pb2 as wpb
    from pdserve.proto import worker_pb2_grpc as wpb_grpc

    try:
        with rpc.make_channel(address, "worker") as ch:
            r = wpb_grpc.WorkerStub(ch).GetStats(wpb.GetStatsRequest(), timeout=10)
    except grpc.RpcError:
        return None
    return {"decode_steps": r.decode_steps, "decode_step_seconds": r.decode_step_seconds}


def scrape(cluster) -> dict[str, Any]:
    """The router's and every worker's /metrics totals, and the workers' step counters."""
    from pdserve.bench.serve_summary import sample_totals

    roles = cluster.current_roles()
    return {"router": sample_totals(get_text(f"http://{cluster.http_address}/metrics")),
            "workers": [{"address": a, "role": roles.get(a),
                         "metrics": sample_totals(get_text(url)), "stats": _stats(a)}
                        for a, url in sorted(cluster.worker_metrics.items())]}


def scrape_diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    from pdserve.bench.serve_summary import diff

    old = {w["address"]: w for w in before["workers"]}
    workers = []
    for w in after["workers"]:
        b = old.get(w["address"], {"metrics": {}, "stats": None})
        stats = None
        if w["stats"] is not None and b["stats"] is not None:
            stats = diff(b["stats"], w["stats"])
        workers.append({"address": w["address"], "role": w["role"],
                        "metrics": diff(b["metrics"], w["metrics"]), "stats": stats})
    return {"router": diff(before["router"], after["router"]), "workers": workers}


CLIENT = "client"  # the bench's own process: its streaming client threads (and scrapes)


def cpu_seconds(procs: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds so far of each named process with its descendants, and of this
    process as `CLIENT`. A process that is gone counts 0 (its difference is then not used)."""
    import psutil

    out: dict[str, float] = {CLIENT: time.process_time()}
    for name, pid in procs.items():
        total = 0.0
        try:
            p = psutil.Process(pid)
            tree = [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for q in tree:
            try:
                t = q.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
        out[name] = total
    return out


def cpu_diff(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each process spent between two `cpu_seconds`; a process new or restarted
    in between (its count went back) is left out rather than given a wrong figure."""
    return {k: round(v - before[k], 3) for k, v in after.items()
            if k in before and v >= before[k]}


def tree_rss_bytes(pids: list[int]) -> int:
    """Resident memory of these processes and all their descendants."""
    import psutil

    seen, total = set(), 0
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs = [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for q in procs:
            if q.pid in seen:
                continue
            seen.add(q.pid)
            try:
                total += q.memory_info().rss
            except psutil.NoSuchProcess:
                pass
    return total
