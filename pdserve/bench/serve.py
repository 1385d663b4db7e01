"""`pdserve bench serve`: the cluster under an OpenAI streaming workload, against its ceiling.

Owns one run on this machine, in order: a cluster started as `pdserve serve` starts it (store,
prefill and decode workers, router with its HTTP API, controller; internal mutual TLS on as
there, or off, or both in alternating passes of the same workload, compared in `serve_tls`:
`--internal-tls`), the workload (`serve_workload`: ShareGPT chats, greedy, `ignore_eos`, at
each concurrency; or a trace replayed open loop) sent through `serve_client`, with the router's
and the workers' metrics scraped before and after each level for the per-hop breakdown
(`serve_summary.hop_breakdown`); then, the cluster stopped, the engine alone decoding the
same prompts at each batch size with the decode worker's thread count (the ceiling,
`serve_baseline.engine_ceiling`); then each optional baseline server (vLLM, llama.cpp)
started by itself and sent the same workload. The result is one JSON
document (`serve_report` prints it as tables and draws the PNG). `--workload structured|tools|n4`
measures one feature instead, with it against without on one cluster (`serve_features`).
Must not tune the cluster beyond the flags given: it measures what a user's `pdserve serve`
does, and reports every failed request rather than retrying it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from pdserve.bench import serve_features as features
from pdserve.bench.common import number_list
from pdserve.bench.serve_probe import (cpu_diff, cpu_seconds, get_text, scrape, scrape_diff,
                                       tree_rss_bytes)
from pdserve.bench.serve_tls import check_mode, cluster_setting, cmdline, pass_order
from pdserve.router.config import DECODE_STREAMS


@dataclass(frozen=True)
class ServeBenchSettings:
    model_path: str = ""  # "" -> the default model (SmolLM2-135M-Instruct GGUF)
    requests: int = 32
    concurrency: tuple[int, ...] = (1, 8, 32)
    max_tokens: int = 64
    min_prompt_chars: int = 16
    max_prompt_chars: int = 1000
    seed: int = 0
    trace: str = ""  # a trace file: replayed open loop instead of the concurrency levels
    token_scale: int = 32
    speedup: float = 1.0
    prefill_workers: int = 1
    decode_workers: int = 1
    threads_per_worker: int | None = None  # None: this machine's cores split evenly
    quantization: str = "none"  # the workers' and the ceiling's (`pdserve serve --quantization`)
    share_cores: bool = True  # the workers lend each other idle cores, as `pdserve serve`
    core_sharing: str = "lend"  # how: `pdserve serve --core-sharing`
    decode_streams: str = "shared"  # the router's `--decode-streams`
    controller: bool = True
    max_predicted_ttft_s: float | None = None  # None: the router's default
    max_local_prefill_tokens: int | None = None  # None: the router's default
    ceiling_repeats: int = 3
    vllm_python: str = ""
    llamacpp_python: str = ""
    ready_timeout_s: float = 1800.0  # a baseline server's start (vLLM compiles at start)
    request_timeout_s: float = 900.0
    vllm_env: tuple[tuple[str, str], ...] = field(default=(("VLLM_CPU_KVCACHE_SPACE", "2"),))
    internal_tls: str = "on"  # the cluster's internal TLS: on (as `pdserve serve`), off, both
    tls_pairs: int = 2  # with both: on/off pairs of passes, the order flipped every pair

    def __post_init__(self) -> None:
        check_mode(self.internal_tls, self.tls_pairs)
        for name in ("requests", "max_tokens", "prefill_workers", "decode_workers",
                     "ceiling_repeats", "token_scale"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.decode_streams not in DECODE_STREAMS:
            raise ValueError(f"--decode-streams must be one of {DECODE_STREAMS}, got "
                             f"{self.decode_streams!r}")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"--concurrency must be positive integers, got {self.concurrency}")
        if self.threads_per_worker is not None and self.threads_per_worker < 1:
            raise ValueError(f"--threads-per-worker must be >= 1, got {self.threads_per_worker}")
        from pdserve.engine.device import DeviceError, check_quantization

        try:  # the cluster and the ceiling run on the CPU in float32
            check_quantization(self.quantization, "cpu", "float32")
        except DeviceError as e:
            raise ValueError(str(e)) from None
        if not 0 < self.min_prompt_chars <= self.max_prompt_chars:
            raise ValueError("--min-prompt-chars must be > 0 and <= --max-prompt-chars")
        for flag, path in (("--vllm-python", self.vllm_python),
                           ("--llamacpp-python", self.llamacpp_python), ("--trace", self.trace)):
            if path and not os.path.isfile(path):
                raise ValueError(f"{flag}: no such file {path!r}")


Ui = Callable[..., None]  # ui(description, completed=None, total=None)


# ---- one server -------------------------------------------------------------------------------
def _model_name(address: str) -> str:
    import json

    return json.loads(get_text(f"http://{address}/v1/models"))["data"][0]["id"]


def run_levels(address: str, model: str, reqs, levels: list[Any], s: ServeBenchSettings,
               ui: Ui, label: str, between: Callable[[], Any] | None = None,
               procs: Callable[[], dict[str, int]] | None = None) -> list[dict[str, Any]]:
    """One warm-up request, then every level; `between()` is called before the first level
    and after each, its results (metric scrapes) kept beside the level; `procs()` names the
    server's processes (name -> pid), whose CPU seconds each level records (`cpu_s`, with the
    bench's own client process)."""
    from pdserve.bench import serve_client as client
    from pdserve.bench.serve_summary import level_figures

    ui(f"{label}: warm-up request", 0, 1)
    warm = client.stream_one(address, reqs[0], model, s.request_timeout_s)
    if warm["error"]:
        raise RuntimeError(f"{label}: the warm-up request failed: {warm['error']}")
    out = []
    mark = between() if between else None
    cpu_mark = cpu_seconds(procs()) if procs else None
    for lv in levels:
        what = f"{label}: {'trace replay' if lv == 'trace' else f'concurrency {lv}'}"
        load = os.getloadavg()[0]  # other work on the machine, as this level starts
        done = [0]
        ui(what, 0, len(reqs))

        def tick() -> None:
            done[0] += 1
            ui(what, done[0], len(reqs))
        if lv == "trace":
            rows, wall = client.run_open(address, model, reqs, s.request_timeout_s, tick)
            batch = max(1, round(client.mean_in_flight(rows, wall)))
        else:
            rows, wall = client.run_closed(address, model, reqs, lv, s.request_timeout_s, tick)
            batch = min(lv, len(reqs))
        fig = level_figures(rows, wall) if wall > 0 else None
        if fig is None:
            raise RuntimeError(f"{label}: no request of level {lv} ran")
        fig.update(concurrency=lv, batch_size=batch, loadavg_1m_start=load)
        if procs:
            cpu_now = cpu_seconds(procs())
            fig["cpu_s"] = cpu_diff(cpu_mark, cpu_now)
            cpu_mark = cpu_now
        if between:
            now = between()
            fig["metrics_diff"] = scrape_diff(mark, now)
            mark = now
        out.append(fig)
    return out


def cluster_spec(s: ServeBenchSettings, model: str, log_dir: str | None,
                 tls_mode: str = "on", tls_dir: str | None = None):
    """The cluster a pass runs: as `pdserve serve` starts it, with the bench's flags."""
    from pdserve.launcher.cluster_spec import free_ports
    from pdserve.launcher.local import ClusterSpec

    return ClusterSpec(model_path=model, quantization=s.quantization,
                       router_port=free_ports(1)[0], http_port=0,
                       prefill_workers=s.prefill_workers, decode_workers=s.decode_workers,
                       threads_per_worker=s.threads_per_worker, share_cores=s.share_cores,
                       core_sharing=s.core_sharing,
                       router_settings={"decode_streams": s.decode_streams},
                       controller=s.controller,
                       max_predicted_ttft_s=s.max_predicted_ttft_s,
                       max_local_prefill_tokens=s.max_local_prefill_tokens, log_dir=log_dir,
                       supervise=True, ready_timeout_s=600,
                       **cluster_setting(tls_mode, tls_dir))


@contextlib.contextmanager
def started(spec, label: str, ui: Ui):
    """The cluster `spec` started (progress says so), as (cluster, seconds it took to be ready,
    its processes' command lines); stopped on leaving."""
    from pdserve.launcher.local import LocalCluster

    ui(f"{label}: starting {spec.prefill_workers} prefill + {spec.decode_workers} decode "
       f"workers, router, controller", 0, 1)
    t0 = time.monotonic()
    with LocalCluster(spec) as cluster:
        yield (cluster, time.monotonic() - t0,
               {c.name: cmdline(c.proc.pid) for c in cluster.children})


def measure_pdserve(model: str, reqs, levels, s: ServeBenchSettings, log_dir: str | None,
                    ui: Ui, tls_mode: str = "on", tls_dir: str | None = None,
                    label: str = "pdserve") -> dict[str, Any]:
    """One pass: a cluster with internal TLS `tls_mode` (`serve_tls.cluster_setting`) under
    every level; the command lines its processes ran with are kept (their TLS flags)."""
    from pdserve.bench.serve_summary import hop_breakdown

    spec = cluster_spec(s, model, log_dir, tls_mode, tls_dir)
    with started(spec, label, ui) as (cluster, start_s, cmdlines):
        name = _model_name(cluster.http_address)
        lv = run_levels(cluster.http_address, name, reqs, levels, s, ui, label,
                        between=lambda: scrape(cluster),
                        procs=lambda: {c.name: c.proc.pid for c in cluster.children})
        rss = tree_rss_bytes([c.proc.pid for c in cluster.children])
        ui(f"{label}: stopping the cluster", 0, 1)
    for fig in lv:
        d = fig["metrics_diff"]
        fig["hops"] = hop_breakdown(d["router"], d["workers"], fig)
    return {"name": "pdserve", "mode": tls_mode, "cmdlines": cmdlines,
            "start_s": start_s, "rss_bytes": rss,
            "config": {"prefill_workers": spec.prefill_workers,
                       "decode_workers": spec.decode_workers,
                       "threads_per_worker": spec.worker_threads(),
                       "share_cores": spec.share_cores,
                       "core_sharing": spec.core_sharing,
                       "decode_streams": s.decode_streams,
                       "max_threads": spec.worker_max_threads(),
                       "controller": spec.controller, "dtype": spec.dtype,
                       "quantization": spec.quantization},
            "levels": lv}


def measure_baseline(kind: str, model: str, reqs, levels, s: ServeBenchSettings,
                     log_dir: str, threads: int, ui: Ui) -> dict[str, Any]:
    """vLLM or llama.cpp started by itself, the same workload through the same client; on a
    failure to start, the reason instead of figures."""
    from pdserve.bench.serve_baseline import (BaselineServer, hf_folder, llamacpp_argv,
                                              vllm_argv, without_eos)
    from pdserve.launcher.cluster_spec import free_ports
    from pdserve.engine.loader import load_model_config

    [port] = free_ports(1)
    name = "bench-model"
    cfg = load_model_config(model)
    max_len = min(4096, cfg.max_position_embeddings)
    env: dict[str, str] = {}
    argv: list[str] = []
    try:
        if kind == "vllm":
            hf = hf_folder(model, progress=lambda what: ui(f"vllm: {what}", 0, 1))
            env = {k: os.environ.get(k, v) for k, v in s.vllm_env}
            argv = vllm_argv(s.vllm_python, hf, port, name, max_len)
        else:
            if not model.endswith(".gguf"):
                return {"name": kind, "skipped": "llama.cpp serves a .gguf file only"}
            argv = llamacpp_argv(s.llamacpp_python, model, port, name, threads, max_len)
            reqs = without_eos(reqs, cfg.eos_token_ids)
        server = BaselineServer(kind, argv, port, os.path.join(log_dir, f"{kind}.log"), env)
        t0 = time.monotonic()
        server.start(s.ready_timeout_s, progress=lambda what: ui(what, 0, 1))
    except Exception as e:  # noqa: BLE001 (no folder, no start: recorded, pdserve's figures kept)
        return {"name": kind, "skipped": f"did not start: {type(e).__name__}: {e}",
                "argv": argv}
    try:
        start_s = time.monotonic() - t0
        lv = run_levels(server.address, name, reqs, levels, s, ui, kind,
                        procs=lambda: {kind: server.proc.pid})
        rss = tree_rss_bytes([server.proc.pid])
        version = _version(kind, s)
    except RuntimeError as e:  # its warm-up failed: the reason, with its log's tail
        return {"name": kind, "skipped": f"{e}; its log ({server.log_path}) ends:\n"
                                         f"{server.tail()}", "argv": argv}
    finally:
        server.stop()
    for fig in lv:
        fig["hops"] = None
    return {"name": kind, "version": version, "start_s": start_s, "rss_bytes": rss,
            "argv": argv, "env": env, "levels": lv}


def _version(kind: str, s: ServeBenchSettings) -> str | None:
    import subprocess

    python, dists = ((s.vllm_python, ("vllm-cpu", "vllm")) if kind == "vllm"
                     else (s.llamacpp_python, ("llama_cpp_python",)))
    probe = ("import importlib.metadata as m, sys\nfor d in sys.argv[1:]:\n    try:\n"
             "        print(d, m.version(d)); break\n    except m.PackageNotFoundError: pass")
    try:
        out = subprocess.run([python, "-c", probe, *dists], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def measure_passes(model: str, reqs, levels, s: ServeBenchSettings, log_dir: str,
                   ui: Ui) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every pdserve pass `s.internal_tls` asks for (`serve_tls.pass_order`). Returns the pass
    the document's other figures use (the first with TLS, as `pdserve serve` runs; with `off`,
    the only one) and the `internal_tls` entry. With both, one TLS folder made here serves
    every TLS pass (each cluster says its setting: this process's follows the last one)."""
    from pdserve.bench.serve_tls import summarize

    order = pass_order(s.internal_tls, s.tls_pairs)
    tls_dir = None
    if s.internal_tls == "both":
        from pdserve.security import pki

        tls_dir = os.path.join(log_dir, "tls")
        pki.init_folder(tls_dir, "bench-serve")
    passes = []
    for i, mode in enumerate(order):
        label = "pdserve" if len(order) == 1 else f"pdserve TLS {mode} ({i + 1}/{len(order)})"
        where = "pdserve" if len(order) == 1 else f"pdserve-{i + 1}-tls-{mode}"
        passes.append(measure_pdserve(model, reqs, levels, s, os.path.join(log_dir, where), ui,
                                      tls_mode=mode, tls_dir=tls_dir, label=label))
    main = next((p for p in passes if p["mode"] == "on"), passes[0])
    return main, summarize(s.internal_tls, order, passes, tls_dir)


# ---- the run --------------------------------------------------------------------------------
def build_workload(s: ServeBenchSettings, model: str):
    from pdserve.bench import serve_workload as wl
    from pdserve.engine.loader import load_model_config

    if s.trace:
        vocab = load_model_config(model).vocab_size
        reqs = wl.trace_requests(s.trace, s.requests, s.max_tokens, token_scale=s.token_scale,
                                 speedup=s.speedup, vocab=(min(1000, vocab // 4), vocab),
                                 max_prompt_tokens=2048, seed=s.seed)
        return reqs, ["trace"], "trace"
    reqs = wl.sharegpt_requests(s.requests, s.max_tokens, s.seed, s.min_prompt_chars,
                                s.max_prompt_chars)
    return reqs, list(s.concurrency), "sharegpt"


def run_bench(s: ServeBenchSettings, out_dir: str | None, ui: Ui) -> dict[str, Any]:
    import tempfile

    from pdserve.bench.serve_baseline import engine_ceiling
    from pdserve.bench.serve_summary import comparison
    from pdserve.bench.serve_workload import prompt_ids
    from pdserve.engine.tokenizer import Tokenizer

    started = time.monotonic()
    load_start = os.getloadavg()[0]
    model = s.model_path
    if not model:
        from pdserve.engine.loader import default_model_path
        model = default_model_path()
    # A fresh folder per run: the store master refuses a journal of another cluster.
    if out_dir:
        os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    log_dir = tempfile.mkdtemp(prefix=time.strftime("run-%Y%m%d-%H%M%S-"),
                               dir=os.path.join(out_dir, "logs") if out_dir else None)
    reqs, levels, source = build_workload(s, model)
    tok = Tokenizer.from_path(model)
    ids = [prompt_ids(r, tok) for r in reqs]
    pd, internal_tls = measure_passes(model, reqs, levels, s, log_dir, ui)
    threads = pd["config"]["max_threads"]
    batches = sorted({lv["batch_size"] for lv in pd["levels"]})
    engine = engine_ceiling(model, {b: ids[:b] for b in batches}, s.max_tokens, threads,
                            repeats=s.ceiling_repeats, quantization=s.quantization,
                            progress=lambda what: ui(what, 0, 1))
    baselines = {}
    for kind, python in (("vllm", s.vllm_python), ("llamacpp", s.llamacpp_python)):
        if python:
            baselines[kind] = measure_baseline(kind, model, reqs, levels, s, log_dir, threads,
                                               ui)
    by_batch = {e["batch_size"]: e for e in engine["levels"]}
    lengths = [len(p) for p in ids]
    return {
        "bench": "serve", "model": os.path.basename(model.rstrip("/")) + (
            "" if s.quantization == "none" else f" ({s.quantization} weights)"),
        "model_path": model,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "python": platform.python_version(), "loadavg_1m_start": load_start,
                    "loadavg_1m_end": os.getloadavg()[0]},
        "settings": {**asdict(s), "model_path": model, "concurrency": list(s.concurrency),
                     "vllm_env": dict(s.vllm_env)},
        "workload": {"source": source, "requests": len(reqs), "levels": levels,
                     "prompt_tokens_mean": sum(lengths) / len(lengths),
                     "prompt_tokens_min": min(lengths), "prompt_tokens_max": max(lengths),
                     "max_tokens": s.max_tokens,
                     "output_tokens_per_level": sum(r.max_tokens for r in reqs),
                     "sampling": "temperature 0, ignore_eos, streamed with usage"},
        "pdserve": pd, "internal_tls": internal_tls, "engine": engine, "baselines": baselines,
        "comparison": comparison(pd["levels"], by_batch,
                                 {k: b["levels"] for k, b in baselines.items() if "levels" in b}),
        "log_dir": log_dir, "seconds": time.monotonic() - started,
    }


# ---- CLI ------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = ServeBenchSettings()
    p.add_argument("--model", default="", help="GGUF file or HF folder (default: SmolLM2-135M)")
    p.add_argument("--requests", type=int, default=None,
                   help=f"requests per concurrency level (with --trace: the trace's first N; "
                        f"default {d.requests}, {features.REQUESTS} with a feature workload)")
    p.add_argument("--concurrency", type=number_list("--concurrency"), default=None,
                   help="comma-separated levels (default 1,8,32; 1,32 with a feature workload)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="output tokens per request (ignore_eos: exactly this many)")
    p.add_argument("--min-prompt-chars", type=int, default=d.min_prompt_chars,
                   help="shortest ShareGPT first turn used, in characters")
    p.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars,
                   help="longest ShareGPT first turn used, in characters")
    p.add_argument("--seed", type=int, default=d.seed, help="the ShareGPT sample's seed")
    p.add_argument("--trace", default="", metavar="PATH",
                   help="replay this trace open loop instead (Azure .csv or Mooncake .jsonl "
                        "of ../shared/traces)")
    p.add_argument("--token-scale", type=int, default=d.token_scale,
                   help="with --trace: prompt lengths divided by this")
    p.add_argument("--speedup", type=float, default=d.speedup,
                   help="with --trace: trace seconds per replay second")
    p.add_argument("--prefill-workers", type=int, default=d.prefill_workers)
    p.add_argument("--decode-workers", type=int, default=d.decode_workers)
    p.add_argument("--threads-per-worker", type=int, default=None,
                   help="compute threads per worker (default: the cores split evenly, as "
                        "`pdserve serve`); the engine ceiling uses the same count")
    p.add_argument("--quantization", choices=("none", "int8"), default=d.quantization,
                   help="the workers' weights (`pdserve serve --quantization`); the engine "
                        "ceiling uses the same")
    p.add_argument("--no-share-cores", action="store_true",
                   help="workers keep their own threads: no cores lent while another idles "
                        "(`pdserve serve --no-share-cores`)")
    p.add_argument("--core-sharing", choices=("lend", "turns"), default=d.core_sharing,
                   help="how the workers share the cores (`pdserve serve --core-sharing`)")
    p.add_argument("--decode-streams", choices=DECODE_STREAMS, default=d.decode_streams,
                   help="the router's decode streams (shared: one per decode worker; "
                        "per_request: a Decode call each)")
    p.add_argument("--no-controller", action="store_true", help="start no controller")
    p.add_argument("--max-predicted-ttft-s", type=float, default=None,
                   help="the router's admission bound (0: off; default: the router's)")
    p.add_argument("--max-local-prefill-tokens", type=int, default=None,
                   help="the router's bound on a prompt's uncached tail that a decode worker "
                        "caching the rest prefills itself (0: off; default: the router's)")
    p.add_argument("--ceiling-repeats", type=int, default=d.ceiling_repeats,
                   help="timed engine runs per batch size (after a warm-up)")
    p.add_argument("--vllm-python", default="", metavar="PATH",
                   help="a python with vllm installed: also measure vLLM's OpenAI server")
    p.add_argument("--llamacpp-python", default="", metavar="PATH",
                   help="a python with llama-cpp-python[server]: also measure llama.cpp")
    p.add_argument("--ready-timeout-s", type=float, default=d.ready_timeout_s,
                   help="how long a baseline server may take to start")
    p.add_argument("--internal-tls", default=d.internal_tls, metavar="on|off|both",
                   help="the cluster's internal TLS: on (mutual TLS, as `pdserve serve`; the "
                        "default), off (--insecure-internal), or both: the same workload on "
                        "a cluster with and one without, in --tls-pairs pairs of passes, "
                        "compared (tokens/s and CPU seconds per token)")
    p.add_argument("--tls-pairs", type=int, default=d.tls_pairs,
                   help="with --internal-tls both: on/off pairs of passes, the order flipped "
                        "every pair (on, off, off, on, ...)")
    features.add_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.add_argument("--out", metavar="DIR", help="write DIR/summary.json and DIR/bench_serve.png "
                   "(a feature workload: DIR/bench_serve_WORKLOAD.png)")
    p.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    return p


def settings_from(args: argparse.Namespace) -> ServeBenchSettings:
    features.check_sharegpt(args)
    d = {**asdict(ServeBenchSettings()), **features.defaults(args.workload)}
    return ServeBenchSettings(
        model_path=args.model,
        requests=d["requests"] if args.requests is None else args.requests,
        concurrency=tuple(d["concurrency"] if args.concurrency is None else args.concurrency),
        max_tokens=args.max_tokens, min_prompt_chars=args.min_prompt_chars,
        max_prompt_chars=args.max_prompt_chars, seed=args.seed,
        trace=args.trace, token_scale=args.token_scale, speedup=args.speedup,
        prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
        threads_per_worker=args.threads_per_worker, quantization=args.quantization,
        share_cores=not args.no_share_cores, core_sharing=args.core_sharing, decode_streams=args.decode_streams,
        controller=not args.no_controller,
        max_predicted_ttft_s=args.max_predicted_ttft_s,
        max_local_prefill_tokens=args.max_local_prefill_tokens, ceiling_repeats=args.ceiling_repeats,
        vllm_python=args.vllm_python, llamacpp_python=args.llamacpp_python,
        ready_timeout_s=args.ready_timeout_s, internal_tls=args.internal_tls,
        tls_pairs=args.tls_pairs)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                               TextColumn, TimeElapsedColumn)

    from pdserve.bench import serve_features_report, serve_report
    from pdserve.output import emit
    from pdserve.bench.serve_workload import WorkloadError

    try:
        s = settings_from(args)
        feature = None if args.workload == "sharegpt" else features.settings_from(args, s)
    except ValueError as e:
        print(f"pdserve bench serve: {e}", file=sys.stderr)
        return 2

    def measure(ui: Ui) -> dict[str, Any]:
        if feature is None:
            return run_bench(s, args.out, ui)
        return features.run_features(feature, args.out, ui)
    console = Console(stderr=True)
    try:
        if console.is_terminal or args.no_progress:
            bar = Progress(SpinnerColumn(), TextColumn("{task.description:<60}"), BarColumn(),
                           MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                           disable=args.no_progress)
            with bar:
                task = bar.add_task("preparing the workload", total=1)

                def ui(what: str, completed: int | None = None,
                       total: int | None = None) -> None:
                    bar.update(task, description=what, completed=completed, total=total)
                result = measure(ui)
        else:  # a log file, not a terminal: a status line per step, and every 10 s within one
            result = measure(StatusLines(console))
    except WorkloadError as e:
        print(f"pdserve bench serve: {e}", file=sys.stderr)
        return 2
    except features.FeatureRefused as e:
        print(f"pdserve bench serve: {e}", file=sys.stderr)
        return 1
    report = serve_report if feature is None else serve_features_report
    return emit(result, json_out=args.json, out_dir=args.out,
                write_outputs=report.write_outputs, print_tables=report.print_tables)


class StatusLines:
    """Progress as plain lines: on each new step, and at most every `every_s` within one (a
    step is the text before any " (": "starting vllm (12 s): ..." is one step)."""

    def __init__(self, console, every_s: float = 10.0, clock=time.monotonic) -> None:
        self.console, self.every_s, self.clock = console, every_s, clock
        self.t0, self.last_step, self.last_s = clock(), None, 0.0

    def __call__(self, what: str, completed: int | None = None,
                 total: int | None = None) -> None:
        now, step = self.clock(), what.split(" (", 1)[0]
        if step == self.last_step and now - self.last_s < self.every_s:
            return
        self.last_step, self.last_s = step, now
        count = f" ({completed}/{total})" if total and total > 1 else ""
        self.console.print(f"[{now - self.t0:6.0f} s] {what}{count}", highlight=False)


def main(argv: list[str] | None = None) -> int:
    p = add_arguments(argparse.ArgumentParser(prog="pdserve bench serve",
                                              description=__doc__.split("\n", 1)[0]))
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
