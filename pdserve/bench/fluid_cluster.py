"""One configuration of `pdserve bench fluid` measured once: a fresh cluster (4 workers, or an
emulated cluster of a multiple of 4), the workload replayed open loop, the request rows, the
roles over time and the controller's flips.

Owns the cluster per configuration (`CONFIGS`: splits of `WORKERS` workers, scaled whole to
a larger emulated cluster), the per-worker CPU cap (`cpu_quota`: root, cgroup v1 cpu
controller, each worker process capped at an equal share of this machine's cores, so a worker
that idles leaves its share unused, as an idle GPU does), the replay and the roles sampler.
Every time it records is in seconds from the replay's start (the arrivals' clock). Must not
decide anything or summarise across runs: it measures one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from array import array
from typing import Any

from pdserve.bench.fluid_workload import Workload, figures

# name -> (prefill workers, decode workers, controller settings or None: controller off)
CONFIGS: dict[str, tuple[int, int, dict[str, bool] | None]] = {
    "static-1:3": (1, 3, None), "static-2:2": (2, 2, None), "static-3:1": (3, 1, None),
    "fluid-token": (2, 2, {"fluid_role": False, "fluid_token": True, "migrate": True}),
    "fluid-role": (2, 2, {"fluid_role": True, "fluid_token": False, "migrate": True}),
    "fluid-both": (2, 2, {"fluid_role": True, "fluid_token": True, "migrate": True}),
    "fluid-role-nomigrate": (2, 2, {"fluid_role": True, "fluid_token": False, "migrate": False}),
    "fluid-both-nomigrate": (2, 2, {"fluid_role": True, "fluid_token": True, "migrate": False}),
}
DEFAULT_SPLIT = "static-2:2"  # the controller configs start from it
WORKERS = 4  # every configuration's cluster: each worker a quarter of the host's cores


def split(name: str, workers: int = WORKERS) -> tuple[int, int]:
    """(prefill, decode) workers of configuration `name` on a cluster of `workers`: its split
    of `WORKERS` scaled (`workers` a multiple of `WORKERS`)."""
    p, d, _ = CONFIGS[name]
    k = workers // WORKERS
    return p * k, d * k


def request_id(i: int) -> str:
    """The id request `i` of a workload is sent with, the same in every run (an emulated
    worker's tokens follow it)."""
    return f"fluid-{i:05d}"


def _cap_cpu(pids: list[int], share_cores: float, tag: str) -> list[str]:
    """Each pid in its own cgroup capped at `share_cores` CPUs; the cgroup paths."""
    root = "/sys/fs/cgroup/cpu"
    made = []
    for pid in pids:
        path = os.path.join(root, f"pdserve-bench-{tag}-{pid}")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
            f.write("100000")
        with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
            f.write(str(int(100000 * share_cores)))
        with open(os.path.join(path, "cgroup.procs"), "w") as f:  # every thread, and new ones
            f.write(str(pid))
        made.append(path)
    return made


def _uncap(paths: list[str]) -> None:
    """Remove the cgroups (the processes have exited by now, or move back to the root)."""
    for p in paths:
        # A cgroup already gone, or a pid that exited meanwhile: nothing left to undo.
        with contextlib.suppress(OSError):
            with open(os.path.join(p, "cgroup.procs")) as f:
                for pid in f.read().split():
                    with open("/sys/fs/cgroup/cpu/cgroup.procs", "w") as root:
                        root.write(pid)
            os.rmdir(p)


def cpu_quota_available() -> bool:
    return os.geteuid() == 0 and os.access("/sys/fs/cgroup/cpu", os.W_OK)


def digest(ids: list[int]) -> str:
    """A request's output tokens as a short hash: two runs' tokens are equal when these are."""
    return hashlib.sha256(array("q", ids).tobytes()).hexdigest()[:20]


class Replay:
    """Open loop: one thread per request at its arrival time; records tokens and times."""

    def __init__(self, address: str, reqs, timeout_s: float, on_done=None) -> None:
        self.address, self.reqs, self.timeout_s, self.on_done = address, reqs, timeout_s, on_done
        self.rows: list[dict[str, Any] | None] = [None] * len(reqs)

    def _one(self, stub, i: int, t0: float) -> None:
        from pdserve.proto import api_pb2, common_pb2

        r = self.reqs[i]
        req = api_pb2.GenerateRequest(
            request_id=request_id(i), token_ids=api_pb2.TokenIds(ids=r.prompt),
            sampling=common_pb2.SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
        arrival = t0 + r.arrival_s
        ids, first, last, error = [], None, None, None
        try:
            for resp in stub.Generate(req, timeout=self.timeout_s):
                if resp.token_ids:
                    now = time.monotonic()
                    first = now if first is None else first
                    last = now
                    ids.extend(resp.token_ids)
        except Exception as e:  # recorded and counted, never hidden
            error = f"{type(e).__name__}: {e.details() if hasattr(e, 'details') else e}"
        n = len(ids)
        self.rows[i] = {
            "phase": r.phase, "arrival_s": r.arrival_s, "digest": digest(ids),
            "output_tokens": n, "ttft_s": None if first is None else first - arrival,
            "tpot_s": (last - first) / (n - 1) if n > 1 else 0.0,
            "error": error if error or n == r.max_tokens else f"{n} of {r.max_tokens} tokens"}
        if self.on_done:
            self.on_done()

    def run(self, t0: float) -> None:
        """Request i sent at monotonic time `t0 + arrival_s`."""
        from pdserve import rpc
        from pdserve.proto import api_pb2_grpc

        with rpc.make_channel(self.address, rpc.PUBLIC) as ch:
            stub = api_pb2_grpc.GenerationStub(ch)
            threads = []
            for i, r in enumerate(self.reqs):
                delay = t0 + r.arrival_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                t = threading.Thread(target=self._one, args=(stub, i, t0), daemon=True)
                t.start()
                threads.append(t)
            for t in threads:
                t.join(self.timeout_s)


def _roles_sampler(router: str, stop: threading.Event, out: list, t0: float) -> None:
    from pdserve import rpc
    from pdserve.proto import router_pb2 as rpb
    from pdserve.proto import router_pb2_grpc as rpb_grpc
    from pdserve.proto import worker_pb2 as wpb

    with rpc.make_channel(router, "router") as ch:
        stub = rpb_grpc.RouterControlStub(ch)
        while not stop.wait(0.5):
            try:
                ws = stub.ListWorkers(rpb.ListWorkersRequest(), timeout=5).workers
            except Exception:
                continue
            out.append((round(time.monotonic() - t0, 2),
                        sum(1 for w in ws if w.role == wpb.ROLE_PREFILL
                            and w.state == rpb.MEMBER_STATE_ACTIVE),
                        sum(1 for w in ws if w.role == wpb.ROLE_DECODE
                            and w.state == rpb.MEMBER_STATE_ACTIVE)))


def _controller_events(audit: list[dict], t0_wall: float) -> tuple[list[dict], int]:
    """The flips that changed a role (start and end in replay seconds) and the running decodes
    moved by flips and by the controller's balance."""
    flips = [{"start_s": round(r["t"] - r["seconds"] - t0_wall, 3),
              "end_s": round(r["t"] - t0_wall, 3), "from": r["from_role"], "to": r["to_role"],
              "ok": r["ok"], "moved": r.get("moved_requests", 0)}
             for r in audit if r.get("event") == "flip" and r["from_role"] != r["to_role"]]
    moved = sum(f["moved"] for f in flips) + sum(
        r.get("moved", 0) for r in audit if r.get("event") == "migrate")
    return flips, moved


DEFAULT_MODEL_PROFILE = "cpu-smollm2-135m"


@contextlib.contextmanager
def _started(make_spec, tries: int = 3):
    """A started `LocalCluster` of `make_spec()`, stopped on leaving; a start that fails is
    tried again on fresh ports (a free port can be taken by another process between choosing
    and binding it)."""
    from pdserve.launcher.local import LocalCluster

    for attempt in range(tries):
        try:
            cluster = LocalCluster(make_spec()).start()  # a failed start stops what it started
            break
        except (RuntimeError, TimeoutError, OSError):
            if attempt == tries - 1:
                raise
    try:
        yield cluster
    finally:
        cluster.stop()


def _in_flight_cap(workers: int) -> int:
    """The router's in-flight limit for a cluster of `workers`: its default (a 4-worker
    cluster's) scaled with the workers."""
    import dataclasses

    from pdserve.router.config import RouterConfig

    default = {f.name: f.default for f in dataclasses.fields(RouterConfig)}["max_in_flight"]
    return default * max(1, workers // WORKERS)


def run_config(name: str, s, model: str, workload: Workload, log_dir: str,
               on_done=None, emulated_profile: str = "") -> dict[str, Any]:
    """`name` measured once under the bench settings `s`: its record, rows included. With
    `s.emulated`, its workers run the emulated engine on `emulated_profile` (a file)."""
    from pdserve.bench.route import _free_port
    from pdserve.controller.audit import read_records
    from pdserve.launcher.local import ClusterSpec

    workers = s.workers
    (p, d), ctl = split(name, workers), CONFIGS[name][2]
    # The step shape the controller projects with: the emulated workers' own, or the default
    # model's measured on a CPU.
    step_profile = emulated_profile or ("" if s.model_path else DEFAULT_MODEL_PROFILE)
    engine = dict(engine="emulated", profile=emulated_profile,
                  kv_scale=s.kv_scale) if s.emulated else {}

    def make_spec() -> ClusterSpec:
        return ClusterSpec(
            model_path=model, router_port=_free_port(), store_port=_free_port(),
            worker_ports=tuple(_free_port() for _ in range(workers)), prefill_workers=p,
            decode_workers=d, **engine,
            num_blocks=s.num_blocks, http_port=None, log_dir=log_dir, threads_per_worker=1,
            controller=ctl is not None, controller_port=_free_port(),
            ttft_slo_ms=s.ttft_slo_ms, itl_slo_ms=s.itl_slo_ms,
            controller_settings={} if ctl is None else {
                **({"step_profile": step_profile} if step_profile else {}),
                **ctl, **s.controller_settings}, ready_timeout_s=600,
            max_predicted_ttft_s=0.0,  # attainment counts every request: admission refuses none
            # nor the in-flight cap, sized for 4 workers: N of them hold N/4 times as many.
            max_in_flight=_in_flight_cap(workers),
            # The controller's mechanisms alone move prefill onto decode workers here.
            max_local_prefill_tokens=0,
            # Its workers stand for separate machines (`--cpu-quota`): each computes on its
            # own thread and never waits for another's step, as sharing the host's cores (the
            # default) would have it do: two threads inside a half-core cap, steps held for
            # another worker's.
            share_cores=False)
    caps: list[str] = []
    load_before = os.getloadavg()[0]
    with _started(make_spec) as cluster:
        if s.cpu_quota and not s.emulated:
            pids = [c.proc.pid for c in cluster.children
                    if c.name.startswith(("prefill", "decode"))]
            caps = _cap_cpu(pids, (os.cpu_count() or 1) / WORKERS, name)
        stop, timeline = threading.Event(), []
        t0 = time.monotonic() + 0.5
        t0_wall = time.time() + (t0 - time.monotonic())
        sampler = threading.Thread(target=_roles_sampler,
                                   args=(cluster.router_control_address, stop, timeline, t0),
                                   daemon=True)
        sampler.start()
        replay = Replay(cluster.router_address, workload.requests, s.request_timeout_s, on_done)
        try:
            replay.run(t0)
        finally:
            stop.set()
            sampler.join(5)
            _uncap(caps)
        audit = read_records(cluster.audit_log) if ctl is not None else []
    flips, moved = _controller_events(audit, t0_wall)
    rows = replay.rows
    ttft, itl = s.ttft_slo_ms / 1000, s.itl_slo_ms / 1000
    return {"name": name, "prefill_workers": p, "decode_workers": d, "controller": ctl,
            "flips": len([f for f in flips if f["ok"]]),
            "failed_flips": len([f for f in flips if not f["ok"]]),
            "drain_seconds": round(sum(f["end_s"] - f["start_s"] for f in flips), 3),
            "flip_log": flips, "decodes_moved": moved, "timeline": timeline,
            "phases": {ph.name: figures([r for r in rows if r["phase"] == ph.name], ttft, itl,
                                        ph.end_s - ph.start_s) for ph in workload.phases},
            "overall": figures(rows, ttft, itl, workload.duration_s),
            "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "rows": rows}
