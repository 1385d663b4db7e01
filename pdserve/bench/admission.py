"""`pdserve bench admission`: does the predicted-TTFT admission keep its word past capacity?

One cluster of real workers (the embedded default model unless told, 1 prefill + 1 decode
worker sharing the host's cores, as `pdserve serve` starts them) and, per mode, a fresh router
over it: `raw` (the prediction from measured peak rates alone, `--uncalibrated-ttft`) and
`calibrated` (the default: corrected by what admitted requests waited). Each router is warmed
(sequential requests until it has measured a prefill rate), then the first `--requests` of a
Mooncake-format trace are replayed open-loop at `--speedup` (faster than the cluster serves:
the point is overload) with `--limit-s` as `--max-predicted-ttft-s`. Each mode sends its own
token ids (no prefix cache carries over). Per mode: requests admitted and refused (429 /
RESOURCE_EXHAUSTED), the admitted requests' TTFT at the client (p50, p99, max, and p99 over the
limit), the prompt tokens admitted per second, and the router's own view (its ttft factor).
Must not assert anything: it reports (`admission_report.py` makes the tables and PNG).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from pdserve.bench.route_replay import Replay, percentile
from pdserve.bench.route_trace import PromptMaker, TraceError, default_trace_path, load_requests
from pdserve.core.errors import ConfigError as BenchConfigError
from pdserve.output import emit

MODES = ("raw", "calibrated")


@dataclass(frozen=True)
class AdmissionBenchSettings:
    trace_path: str = ""  # "" -> ../shared/traces/mooncake_conversation_trace.jsonl
    requests: int = 400
    token_scale: int = 32  # a 512-token trace block becomes 16 tokens
    speedup: float = 4.0  # trace seconds per replay second
    limit_s: float = 4.0  # the routers' --max-predicted-ttft-s
    max_tokens: int = 16
    modes: tuple[str, ...] = MODES
    model_path: str = ""  # "" -> the embedded default (SmolLM2-135M-Instruct)
    max_prompt_tokens: int = 1024
    max_in_flight: int = 256  # client threads; the routers' own bound is the default
    warmup_requests: int = 24
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.requests < 1 or self.warmup_requests < 1:
            raise BenchConfigError("requests and warmup_requests must be >= 1")
        if not self.speedup > 0:
            raise BenchConfigError(f"speedup must be > 0, got {self.speedup}")
        if not self.limit_s > 0:
            raise BenchConfigError(f"limit_s must be > 0, got {self.limit_s}")
        bad = [m for m in self.modes if m not in MODES]
        if not self.modes or bad:
            raise BenchConfigError(f"modes must be among {MODES}, got {bad or '()'}")


QUICK = AdmissionBenchSettings(requests=120, warmup_requests=8, max_tokens=4)


def _warm(address: str, maker: PromptMaker, reqs, s: AdmissionBenchSettings,
          rate_known) -> int:
    """Sequential requests (not measured) until the router has a prefill rate; how many."""
    for n in range(1, 10 * s.warmup_requests + 1):
        Replay(address, [maker.prompt(reqs[n % len(reqs)])], [0.0], 1, s.request_timeout_s,
               max_tokens=s.max_tokens).run()
        if n >= s.warmup_requests and rate_known():
            return n
    raise RuntimeError(f"the router measured no prefill rate after {n} requests")


def _router_view(http: str) -> dict[str, Any]:
    """What the router's /health says of its admission (queue, rates, TTFT factor)."""
    import httpx

    return httpx.get(f"http://{http}/health", timeout=30).json()


def run_mode(cluster, mode: str, k: int, s: AdmissionBenchSettings, reqs, progress) -> dict:
    from pdserve.launcher.cluster_spec import free_ports

    port, http_port = free_ports(2)
    settings = {"max_predicted_ttft_s": s.limit_s, "uncalibrated_ttft": mode == "raw",
                "http_port": http_port}
    address = cluster.add_router(f"router-{mode}", port, cluster.spec.routing, settings)
    http = f"{cluster.spec.host}:{http_port}"
    try:
        maker = PromptMaker(s.token_scale, 1000 + k, s.max_prompt_tokens)
        warm = _warm(address, maker, reqs, s,
                     lambda: _router_view(http).get("prefill_peak_tokens_per_s"))
        maker = PromptMaker(s.token_scale, k, s.max_prompt_tokens)
        prompts = [maker.prompt(r) for r in reqs]
        arrivals = [r.arrival_s / s.speedup for r in reqs]
        replay = Replay(address, prompts, arrivals, s.max_in_flight, s.request_timeout_s,
                        on_done=progress, max_tokens=s.max_tokens)
        wall_s = replay.run()
        view = _router_view(http)
    finally:
        cluster.stop_child(address)
    return summarize_mode(mode, replay.codes, replay.ttft_s, [len(p) for p in prompts],
                          wall_s, s.limit_s, warm, view)


def summarize_mode(mode: str, codes: list[str], ttfts: list[float | None], prompt_tokens:
                   list[int], wall_s: float, limit_s: float, warmup: int,
                   view: dict[str, Any]) -> dict[str, Any]:
    """One mode's figures from its requests' endings and TTFTs (pure)."""
    ok = [i for i, c in enumerate(codes) if c == "OK" and ttfts[i] is not None]
    t = sorted(ttfts[i] for i in ok)
    refused = sum(c == "RESOURCE_EXHAUSTED" for c in codes)
    pct = (lambda q: percentile(t, q)) if t else (lambda q: None)
    return {
        "mode": mode, "sent": len(codes), "admitted": len(ok), "refused": refused,
        "failed": len(codes) - len(ok) - refused,
        "ttft_p50_s": pct(0.5), "ttft_p99_s": pct(0.99), "ttft_max_s": t[-1] if t else None,
        "p99_over_limit": pct(0.99) / limit_s if t else None,
        "within_limit": sum(x <= limit_s for x in t) / len(t) if t else None,
        "admitted_prompt_tokens_per_s": sum(prompt_tokens[i] for i in ok) / wall_s,
        "wall_s": wall_s, "warmup_requests": warmup,
        "router_factor": view.get("predicted_ttft_factor"),
        "router_peak_tokens_per_s": view.get("prefill_peak_tokens_per_s"),
        "ttfts_s": t,
        # (request index, TTFT) of the admitted, in arrival order: when the misses happened.
        "ttft_by_arrival": [[i, round(ttfts[i], 4)] for i in ok],
    }


def measure(s: AdmissionBenchSettings, progress: bool = True) -> dict[str, Any]:
    from pdserve.bench.route import _Progress
    from pdserve.engine.model_files import default_model_path
    from pdserve.launcher.cluster_spec import free_ports
    from pdserve.launcher.local import ClusterSpec, LocalCluster

    trace = s.trace_path or default_trace_path()
    reqs = load_requests(trace, s.requests)
    model = s.model_path or default_model_path()
    started = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="pdserve-bench-admission-")
    modes: dict[str, Any] = {}
    try:
        ports = free_ports(4)
        spec = ClusterSpec(model_path=model, router_port=ports[0], store_port=ports[1],
                           worker_ports=tuple(ports[2:4]), prefill_workers=1, decode_workers=1,
                           http_port=None, controller=False, log_dir=os.path.join(tmp, "logs"),
                           max_predicted_ttft_s=s.limit_s)
        with _Progress(progress) as bar, LocalCluster(spec) as cluster:
            bar.note(f"1 prefill + 1 decode worker of {os.path.basename(model)}; "
                     f"{len(reqs)} trace requests at {s.speedup:g}x, limit {s.limit_s:g} s")
            for k, mode in enumerate(s.modes):
                task = bar.task(f"{mode:<11}", len(reqs))
                modes[mode] = run_mode(cluster, mode, k, s, reqs, lambda t=task: bar.step(t))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"bench": "admission", "settings": asdict(s), "trace": os.path.basename(trace),
            "model": os.path.basename(model), "modes": modes,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "wall_s": time.perf_counter() - started}


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = AdmissionBenchSettings()
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="Mooncake-format JSONL trace (default: the shared conversation trace)")
    p.add_argument("--requests", type=int, default=None, help=f"default {d.requests}")
    p.add_argument("--token-scale", type=int, default=None, help=f"default {d.token_scale}")
    p.add_argument("--speedup", type=float, default=None, help=f"default {d.speedup:g}")
    p.add_argument("--limit-s", type=float, default=None,
                   help=f"the routers' --max-predicted-ttft-s (default {d.limit_s:g})")
    p.add_argument("--max-tokens", type=int, default=None, help=f"default {d.max_tokens}")
    p.add_argument("--modes", default=None, help=f"comma-separated from {','.join(MODES)}")
    p.add_argument("--model", default=None, help="model path (default: the embedded default)")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK.requests} requests, {QUICK.max_tokens} tokens each")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.add_argument("--out", metavar="DIR", help="write DIR/admission.{json,png,md}")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return p


def settings_from_args(a: argparse.Namespace) -> AdmissionBenchSettings:
    base = QUICK if a.quick else AdmissionBenchSettings()
    modes = tuple(m.strip() for m in a.modes.split(",") if m.strip()) if a.modes else None
    given = {"trace_path": a.trace, "requests": a.requests, "token_scale": a.token_scale,
             "speedup": a.speedup, "limit_s": a.limit_s, "max_tokens": a.max_tokens,
             "modes": modes, "model_path": a.model}
    return replace(base, **{k: v for k, v in given.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.admission_report import print_tables, write_outputs

    try:
        result = measure(settings_from_args(args), progress=not args.no_progress)
    except (BenchConfigError, TraceError) as e:
        print(f"pdserve bench admission: {e}", file=sys.stderr)
        return 2
    return emit(result, json_out=args.json, out_dir=args.out, write_outputs=write_outputs,
                print_tables=print_tables)


def main(argv: list[str] | None = None) -> int:
    p = add_arguments(argparse.ArgumentParser(prog="pdserve bench admission",
                                              description=__doc__.split("\n", 1)[0]))
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
