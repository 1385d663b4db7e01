"""Chaos: kill -9 one process of a running cluster under streaming load, and judge the outcome.

Owns one fault run on a `LocalCluster` (`run_fault`): streams a workload of greedy and seeded
requests, kills the chosen process while they are in flight and more are arriving, waits for
every request, and compares each with a fault-free run of the same requests; it measures the
time from the kill until the supervisor's replacement is healthy, and what the router's health
said meanwhile. `pdserve bench chaos` runs every fault on one cluster (the default model) and
reports a table, JSON and a PNG; `tests/chaos/` runs the same code on a tiny model.
Must not: change the cluster's code paths (it only kills and observes), retry anything a
user's client would not (the clients resend only on UNAVAILABLE, see `chaos_client`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field

from pdserve import rpc
from pdserve.bench.chaos_client import HealthProbe, RequestSpec, StreamClient

# Fault name -> (the supervisor's kind, the launcher's child-name prefix).
FAULTS: dict[str, tuple[str, str]] = {
    "prefill": ("worker", "prefill-"),
    "decode": ("worker", "decode-"),
    "node": ("node", "kvnode-"),
    "master": ("master", "kvmaster"),
    "router": ("router", "router"),
    "controller": ("controller", "controller"),
}


@dataclass
class FaultResult:
    fault: str
    victim: str  # the killed child's name
    requests: int
    in_flight_at_kill: int
    sent_after_kill: int  # requests that arrived while the process was dead or restarting
    completed_correct: int
    wrong: int  # completed, but not the fault-free tokens
    lost: int  # ended with an error
    resends: int  # streams a client had to send again (the router itself died)
    restarted: bool
    heal_s: float | None  # kill -> replacement healthy (None: never)
    not_serving_s: float  # seconds the router's health said NOT_SERVING or did not answer
    serves_after: bool  # a fresh request after the heal gives the fault-free tokens
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def reference(router: str, specs: list[RequestSpec], deadline_s: float = 300.0
              ) -> list[list[int]]:
    """Every request's tokens on the fault-free cluster, all in flight together."""
    clients = [StreamClient(router, s, time.monotonic() + deadline_s) for s in specs]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    bad = [c.error for c in clients if c.error or c.finish is None]
    if bad:
        raise RuntimeError(f"the fault-free run failed: {bad[:3]}")
    return [c.ids for c in clients]


def _child(cluster, name: str):
    return next(c for c in cluster.children if c.name == name)


def pick_victim(cluster, fault: str) -> str:
    """The child to kill: for a worker fault, one whose live role is that fault's role."""
    kind, prefix = FAULTS[fault]
    names = [c.name for c in cluster.children if c.name.startswith(prefix)]
    if kind == "worker":
        from pdserve.proto import worker_pb2 as wpb
        from pdserve.proto import worker_pb2_grpc as wpb_grpc

        want = wpb.ROLE_PREFILL if fault == "prefill" else wpb.ROLE_DECODE
        live = []
        for c in cluster.children:
            if not (c.name.startswith("prefill-") or c.name.startswith("decode-")):
                continue
            with rpc.make_channel(c.address, "worker") as ch:
                role = wpb_grpc.WorkerStub(ch).GetStats(wpb.GetStatsRequest(), timeout=10).role
            if role == want:
                live.append(c.name)
        names = live
    if not names:
        raise RuntimeError(f"no running process for fault {fault!r}")
    return names[0]


def _healthy(cluster, name: str) -> bool:
    """The child `name` runs and answers: gRPC health SERVING, or for a storage node (no gRPC
    server), its ready line: printed by this process once the master took its registration."""
    c = _child(cluster, name)
    if c.proc.poll() is not None:
        return False
    if not c.address:
        try:
            with open(c.log_path, errors="replace") as f:
                return f'"event": "ready", "pid": {c.proc.pid},' in f.read()
        except OSError:
            return False
    try:
        # A router answers on its control listener (its client port may be TLS of its own).
        rpc.wait_healthy(c.probe, timeout_s=1.0)
        return True
    except TimeoutError:
        return False


class _HealWatch(threading.Thread):
    """From the kill on: the seconds until the supervisor restarted the victim and the
    replacement is healthy (`heal_s`, None until then or past the timeout)."""

    def __init__(self, cluster, name: str, kind: str, restarts_before: int, killed_at: float,
                 timeout_s: float) -> None:
        super().__init__(daemon=True)
        self.cluster, self.name, self.kind = cluster, name, kind
        self.restarts_before, self.killed_at, self.timeout_s = restarts_before, killed_at, timeout_s
        self.heal_s: float | None = None

    def run(self) -> None:
        while time.monotonic() < self.killed_at + self.timeout_s:
            if (self.cluster.restarts.get(self.kind, 0) > self.restarts_before
                    and _healthy(self.cluster, self.name)):
                self.heal_s = time.monotonic() - self.killed_at
                return
            time.sleep(0.05)


def run_fault(cluster, fault: str, specs: list[RequestSpec], ref: list[list[int]], *,
              stagger_s: float = 0.02, kill_when_decoding: int = 12, min_tokens: int = 4,
              deadline_s: float = 300.0, heal_timeout_s: float = 180.0) -> FaultResult:
    """Stream `specs` (one started every `stagger_s`), kill -9 the fault's process once
    `kill_when_decoding` streams in flight have `min_tokens` tokens (the rest are still to
    come or in prefill), then wait for every stream and for the replacement to be healthy."""
    kind, _ = FAULTS[fault]
    victim = pick_victim(cluster, fault)
    restarts_before = cluster.restarts.get(kind, 0)
    probe = HealthProbe(cluster.router_address).start()
    deadline = time.monotonic() + deadline_s
    clients = [StreamClient(cluster.router_address, s, deadline) for s in specs]
    killed_at = None
    in_flight = 0
    sent_before = len(clients)
    try:
        for i, c in enumerate(clients):
            c.start()
            if killed_at is None and _decoding(clients[:i + 1], min_tokens) >= kill_when_decoding:
                in_flight = sum(x.is_alive() for x in clients[:i + 1])
                sent_before = i + 1
                killed_at = _kill(cluster, victim)
            time.sleep(stagger_s)
        while killed_at is None and any(c.is_alive() for c in clients):
            if _decoding(clients, min_tokens) >= kill_when_decoding:
                in_flight = sum(x.is_alive() for x in clients)
                killed_at = _kill(cluster, victim)
            time.sleep(0.02)
        if killed_at is None:
            raise RuntimeError("every request ended before the kill: make them longer")
        watch = _HealWatch(cluster, victim, kind, restarts_before, killed_at, heal_timeout_s)
        watch.start()
        for c in clients:
            c.join(timeout=max(1.0, deadline - time.monotonic()))
        watch.join()
        heal_s = watch.heal_s
    finally:
        probe.stop()
    correct = sum(1 for c, r in zip(clients, ref) if c.error is None and c.ids == r)
    lost = sum(1 for c in clients if c.error is not None or c.is_alive())
    serves_after = False
    if heal_s is not None:
        after = StreamClient(cluster.router_address, specs[0], time.monotonic() + 120)
        after.start()
        after.join()
        serves_after = after.error is None and after.ids == ref[0]
    return FaultResult(
        fault=fault, victim=victim, requests=len(specs), in_flight_at_kill=in_flight,
        sent_after_kill=len(specs) - sent_before,
        completed_correct=correct, wrong=len(specs) - correct - lost, lost=lost,
        resends=sum(c.resends for c in clients),
        restarted=cluster.restarts.get(kind, 0) > restarts_before, heal_s=heal_s,
        not_serving_s=round(probe.not_serving_s(), 3), serves_after=serves_after,
        errors=sorted({c.error for c in clients if c.error})[:5])


def _decoding(clients: list[StreamClient], min_tokens: int) -> int:
    """Streams still in flight that have shown at least `min_tokens` tokens."""
    return sum(1 for x in clients if x.is_alive() and len(x.ids) >= min_tokens)


def _kill(cluster, name: str) -> float:
    c = _child(cluster, name)
    c.proc.kill()
    return time.monotonic()



def add_arguments(p):
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--out", default=None, help="write chaos.json and chaos.png here")
    p.add_argument("--model", default="", help="model path (default: SmolLM2-135M GGUF)")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"comma-separated among {', '.join(FAULTS)}")
    p.add_argument("--requests", type=int, default=20, help="streaming requests per fault")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p


def run_bench(model_path: str, faults: list[str], n: int, prompt_tokens: int, max_tokens: int,
              seed: int, log_dir: str | None, progress=lambda fault, done: None) -> dict:
    """Every fault in turn on one 2 prefill + 2 decode cluster with its controller."""
    import os
    import platform

    from pdserve.bench.chaos_client import workload
    from pdserve.launcher.cluster_spec import free_ports
    from pdserve.launcher.local import ClusterSpec, LocalCluster
    from pdserve.engine.loader import load_model_config

    vocab = load_model_config(model_path).vocab_size
    specs = workload(n, prompt_tokens, max_tokens, vocab, seed)
    spec = ClusterSpec(model_path=model_path, prefill_workers=2, decode_workers=2,
                       router_port=free_ports(1)[0], http_port=None, log_dir=log_dir,
                       supervise=True)
    results = []
    started = time.monotonic()
    with LocalCluster(spec) as cluster:
        ref = reference(cluster.router_address, specs)
        for i, fault in enumerate(faults):
            progress(fault, i)
            results.append(run_fault(cluster, fault, specs, ref).as_dict())
        progress("done", len(faults))
    return {"bench": "chaos", "model": os.path.basename(model_path),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "settings": {"requests": n, "prompt_tokens": prompt_tokens,
                         "max_tokens": max_tokens, "seed": seed, "prefill_workers": 2,
                         "decode_workers": 2, "sampling": "even greedy, odd seeded (T 0.9)"},
            "faults": results, "seconds": round(time.monotonic() - started, 1)}


def run(args) -> int:
    import os

    from rich.progress import Progress

    from pdserve.bench import chaos_report
    from pdserve.output import emit

    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        raise SystemExit(f"--faults: unknown {', '.join(unknown)}; choose among "
                         f"{', '.join(FAULTS)}")
    if args.requests < 1 or args.max_tokens < 8:
        raise SystemExit("--requests must be >= 1 and --max-tokens >= 8")
    model = args.model
    if not model:
        from pdserve.engine.loader import default_model_path
        model = default_model_path()
    with Progress(transient=True, disable=args.json) as bar:
        task = bar.add_task("fault-free run", total=len(faults))

        def progress(fault: str, done: int) -> None:
            bar.update(task, completed=done, description=f"kill -9 {fault:<10}")
        result = run_bench(model, faults, args.requests, args.prompt_tokens, args.max_tokens,
                           args.seed, os.path.join(args.out, "logs") if args.out else None,
                           progress)
    return emit(result, json_out=args.json, out_dir=args.out,
                write_outputs=chaos_report.write_outputs, print_tables=chaos_report.print_tables)
