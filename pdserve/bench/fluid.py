"""`pdserve bench fluid`: the controller against static splits on a phase-shifting workload.

Owns one benchmark run on this machine. The same open-loop arrivals (`fluid_workload`: a
prefill-heavy phase from the Azure code trace, then a decode-heavy phase from the Mooncake
conversation trace) are replayed, greedy, against a fresh 4-worker cluster per configuration:
every static split (1:3, 2:2, 3:1, controller off), and from 2:2 the controller with FluidToken
only (prefill offload to decode workers), FluidRole only (role flips), and both. Per phase and
overall: TTFT and ITL p50/p90, SLO attainment, goodput, flips and drain time, roles over time
(PNG). Every configuration's tokens are compared with the static 2:2 run's, and the first
requests with the single-process engine's.

Each worker is one "accelerator": with `cpu_quota` (root, cgroup v1 cpu controller) each worker
process is capped at an equal share of this machine's cores, so a worker that idles leaves its
share unused, as an idle GPU does; without it, idle workers' cores go to busy ones and moving
roles buys little. The report says which was in force. Must not decide anything: it measures.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pdserve.output import emit
from pdserve.bench.fluid_workload import Shape, figures, make_workload, traces_dir

CONFIGS = {  # name -> (prefill workers, decode workers, controller: None or (role, token))
    "static-1:3": (1, 3, None), "static-2:2": (2, 2, None), "static-3:1": (3, 1, None),
    "fluid-token": (2, 2, (False, True)), "fluid-role": (2, 2, (True, False)),
    "fluid-both": (2, 2, (True, True)),
}


@dataclass(frozen=True)
class FluidBenchSettings:
    model_path: str = ""  # "" -> the default model (SmolLM2-135M-Instruct GGUF)
    configs: tuple[str, ...] = tuple(CONFIGS)
    phase_s: float = 60.0
    prefill_rps: float = 0.8
    decode_rps: float = 0.5
    shape: Shape = Shape()
    # Looser than `pdserve serve`'s defaults: each worker here has half a core (cpu_quota).
    ttft_slo_ms: float = 3000.0
    itl_slo_ms: float = 300.0
    num_blocks: int = 1024
    cpu_quota: bool = True
    seed: int = 0
    engine_checks: int = 4  # first requests also checked against the in-process engine
    # More controller settings (`ControllerConfig` fields) of the configs that run one.
    controller_settings: Mapping[str, Any] = field(
        default_factory=lambda: {"sustain_s": 2.0, "cooldown_s": 10.0})
    request_timeout_s: float = 300.0
    logs_dir: str = ""  # keep every process's log and the audit logs here ("" : a temp dir)

    def __post_init__(self) -> None:
        bad = [c for c in self.configs if c not in CONFIGS]
        if bad or not self.configs:
            raise ValueError(f"configs: choose from {', '.join(CONFIGS)}, got {bad or '()'}")
        if self.phase_s <= 0 or self.prefill_rps <= 0 or self.decode_rps <= 0:
            raise ValueError("phase_s, prefill_rps and decode_rps must be > 0")


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


class Replay:
    """Open loop: one thread per request at its arrival time; records tokens and times."""

    def __init__(self, address: str, reqs, timeout_s: float, on_done=None) -> None:
        self.address, self.reqs, self.timeout_s, self.on_done = address, reqs, timeout_s, on_done
        self.rows: list[dict[str, Any] | None] = [None] * len(reqs)

    def _one(self, stub, i: int, t0: float) -> None:
        from pdserve.proto import api_pb2, common_pb2

        r = self.reqs[i]
        req = api_pb2.GenerateRequest(
            request_id=uuid.uuid4().hex, token_ids=api_pb2.TokenIds(ids=r.prompt),
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
            error = f"{type(e).__name__}: {getattr(e, 'details', lambda: e)()}"
        n = len(ids)
        self.rows[i] = {
            "phase": r.phase, "arrival_s": r.arrival_s, "ids": ids, "output_tokens": n,
            "ttft_s": None if first is None else first - arrival,
            "tpot_s": (last - first) / (n - 1) if n > 1 else 0.0,
            "error": error if error or n == r.max_tokens else f"{n} of {r.max_tokens} tokens"}
        if self.on_done:
            self.on_done()

    def run(self) -> None:
        from pdserve import rpc
        from pdserve.proto import api_pb2_grpc

        with rpc.make_channel(self.address, rpc.PUBLIC) as ch:
            stub = api_pb2_grpc.GenerationStub(ch)
            t0 = time.monotonic() + 0.5
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
            out.append((time.monotonic() - t0,
                        sum(1 for w in ws if w.role == wpb.ROLE_PREFILL
                            and w.state == rpb.MEMBER_STATE_ACTIVE),
                        sum(1 for w in ws if w.role == wpb.ROLE_DECODE
                            and w.state == rpb.MEMBER_STATE_ACTIVE)))


def run_config(name: str, s: FluidBenchSettings, model: str, reqs, log_dir: str,
               on_done=None) -> dict[str, Any]:
    from pdserve.controller.audit import read_records
    from pdserve.launcher.local import ClusterSpec, LocalCluster
    from pdserve.bench.route import _free_port

    p, d, ctl = CONFIGS[name]
    ctl_settings = {} if ctl is None else {"fluid_role": ctl[0], "fluid_token": ctl[1],
                                           **s.controller_settings}
    spec = ClusterSpec(
        model_path=model, router_port=_free_port(), store_port=_free_port(),
        worker_ports=tuple(_free_port() for _ in range(4)), prefill_workers=p, decode_workers=d,
        num_blocks=s.num_blocks, http_port=None, log_dir=log_dir, threads_per_worker=1,
        controller=ctl is not None, controller_port=_free_port(), ttft_slo_ms=s.ttft_slo_ms,
        itl_slo_ms=s.itl_slo_ms, controller_settings=ctl_settings, ready_timeout_s=600,
        max_predicted_ttft_s=0.0,  # attainment counts every request: admission refuses none
        # The controller's mechanisms alone move prefill onto decode workers here.
        max_local_prefill_tokens=0,
        # Its workers stand for separate machines (`--cpu-quota`): none ever waits for another's
        # turn on this host's cores, whatever the default.
        core_sharing="lend")
    caps: list[str] = []
    with LocalCluster(spec) as cluster:
        if s.cpu_quota:
            pids = [c.proc.pid for c in cluster.children if c.name.startswith(("prefill", "decode"))]
            caps = _cap_cpu(pids, (os.cpu_count() or 1) / 4, name)
        stop, timeline = threading.Event(), []
        t0 = time.monotonic()
        sampler = threading.Thread(target=_roles_sampler,
                                   args=(cluster.router_control_address, stop, timeline,
                                         t0),
                                   daemon=True)
        sampler.start()
        replay = Replay(cluster.router_address, reqs, s.request_timeout_s, on_done)
        try:
            replay.run()
        finally:
            stop.set()
            sampler.join(5)
            _uncap(caps)
        audit = read_records(cluster.audit_log) if ctl is not None else []
    flips = [r for r in audit if r.get("event") == "flip" and r["from_role"] != r["to_role"]]
    rows = replay.rows
    out: dict[str, Any] = {"name": name, "prefill_workers": p, "decode_workers": d,
                           "controller": None if ctl is None else
                           {"fluid_role": ctl[0], "fluid_token": ctl[1]},
                           "flips": len([f for f in flips if f["ok"]]),
                           "failed_flips": len([f for f in flips if not f["ok"]]),
                           "drain_seconds": sum(f["seconds"] for f in flips),
                           "flip_times_s": [round(f["t"], 3) for f in flips],
                           "timeline": timeline}
    ttft, itl = s.ttft_slo_ms / 1000, s.itl_slo_ms / 1000
    for phase in ("prefill", "decode"):
        out[phase] = figures([r for r in rows if r["phase"] == phase], ttft, itl, s.phase_s)
    out["overall"] = figures(rows, ttft, itl, 2 * s.phase_s)
    out["met_by_arrival"] = [  # for the attainment-over-time plot
        [round(r["arrival_s"], 2), r["error"] is None and r["ttft_s"] <= ttft
         and r["tpot_s"] <= itl] for r in rows]
    out["rows"] = rows
    return out


def _engine_check(model: str, reqs, rows, n: int) -> int:
    """Requests among the first `n` whose tokens differ from the in-process engine's."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model))
    bad = 0
    for r, row in list(zip(reqs, rows))[:n]:
        ref = engine.generate([list(r.prompt)], SamplingParams(max_tokens=r.max_tokens,
                                                               ignore_eos=True))[0]
        bad += row["ids"] != ref
    return bad


def run_bench(s: FluidBenchSettings, progress=None) -> dict[str, Any]:
    from pdserve.engine.loader import default_model_path, load_model_config

    model = s.model_path or default_model_path()
    if s.cpu_quota and not cpu_quota_available():
        s = replace(s, cpu_quota=False)
    vocab = load_model_config(model).vocab_size
    reqs = make_workload(traces_dir(), s.shape, phase_s=s.phase_s, prefill_rps=s.prefill_rps,
                         decode_rps=s.decode_rps, vocab=(100, vocab - 100), seed=s.seed)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-fluid-") as tmp:
        tmp = s.logs_dir or tmp
        for name in s.configs:
            task = progress(name, len(reqs)) if progress else None
            runs[name] = run_config(name, s, model, reqs, os.path.join(tmp, name), task)
    base = runs.get("static-2:2") or next(iter(runs.values()))
    for r in runs.values():
        r["mismatches_vs_" + base["name"]] = sum(
            a["ids"] != b["ids"] for a, b in zip(r["rows"], base["rows"])
            if a["error"] is None and b["error"] is None)
    engine_bad = _engine_check(model, reqs, base["rows"], s.engine_checks)
    for r in runs.values():
        del r["rows"]
    return {"settings": {**asdict(s), "model": model}, "machine": _machine(),
            "requests": {"prefill": sum(r.phase == "prefill" for r in reqs),
                         "decode": sum(r.phase == "decode" for r in reqs)},
            "engine_checked": min(s.engine_checks, len(reqs)),
            "engine_mismatches": engine_bad, "runs": runs, "aims": _aims(runs)}


def _aims(runs: dict[str, Any]) -> dict[str, Any]:
    def att(name, part):
        r = runs.get(name)
        return None if r is None else r[part]["slo_attainment"]

    statics = [n for n in runs if n.startswith("static")]
    out: dict[str, Any] = {}
    if "fluid-both" in runs and "static-2:2" in runs:
        gain = att("fluid-both", "overall") - att("static-2:2", "overall")
        out["both_minus_static_2_2_overall_points"] = round(100 * gain, 1)
        out["beats_static_2_2_by_20_points"] = gain >= 0.2
    if "fluid-both" in runs and statics:
        for part in ("prefill", "decode"):
            best = max(statics, key=lambda n: att(n, part))
            out[f"best_static_{part}"] = best
            out[f"both_no_worse_than_best_static_{part}"] = att("fluid-both", part) >= att(
                best, part)
    return out


def _machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "loadavg_1m": os.getloadavg()[0]}


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--out", default=None, help="write fluid.json and fluid.png here")
    p.add_argument("--model", default="", help="model path (default: SmolLM2-135M GGUF)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated among {', '.join(CONFIGS)}")
    p.add_argument("--phase-s", type=float, default=60.0, help="seconds of each phase")
    p.add_argument("--prefill-rps", type=float, default=0.8)
    p.add_argument("--decode-rps", type=float, default=0.5)
    p.add_argument("--ttft-slo-ms", type=float, default=3000.0)
    p.add_argument("--itl-slo-ms", type=float, default=300.0)
    p.add_argument("--no-cpu-quota", action="store_true",
                   help="let workers share every core (no per-worker CPU cap)")
    p.add_argument("--seed", type=int, default=0)
    return p


def run(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from pdserve.bench import fluid_report

    s = FluidBenchSettings(model_path=args.model, configs=tuple(
        c.strip() for c in args.configs.split(",") if c.strip()), phase_s=args.phase_s,
        prefill_rps=args.prefill_rps, decode_rps=args.decode_rps, ttft_slo_ms=args.ttft_slo_ms,
        itl_slo_ms=args.itl_slo_ms, cpu_quota=not args.no_cpu_quota, seed=args.seed,
        logs_dir=os.path.join(args.out, "logs") if args.out else "")
    with Progress(transient=True, disable=args.json) as bar:
        def progress(name: str, total: int):
            task = bar.add_task(f"{name:<12}", total=total)
            return lambda: bar.advance(task)
        result = run_bench(s, progress)
    return emit(result, json_out=args.json, out_dir=args.out,
                write_outputs=fluid_report.write_outputs, print_tables=fluid_report.print_tables)
