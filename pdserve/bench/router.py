"""`pdserve bench router`: what a router costs per streamed token and per request, and its
highest rates per core.

For each router count N (`--routers 1,2`): a cluster of emulated workers (the real worker
processes with a step-time profile, `pdserve emulate`'s) behind N routers sharing the client
ports, as `pdserve serve --routers N` runs them. For each API (the OpenAI HTTP API, gRPC):
streamed chat completions (real chat templating, tokenization and detokenization) arrive
open-loop at rising rates, a window each. Per window: requests sent, answered, refused;
tokens; TTFT and inter-chunk gaps (p50, p99) at the client; and the routers' own CPU seconds
(`/proc/PID/stat`, minus their idle rate), so the cost holds on a shared machine.

From the windows, per API (pure functions below, unit-tested):
- CPU microseconds per streamed token and per request: a least-squares fit of CPU seconds on
  (requests, tokens) over a short-answer window and the long-answer ones;
- what one router core carries at that cost: tokens/s and requests/s at the answer length;
- the highest rate at which the router adds at most `ttft_limit_s` to p99 TTFT and
  `itl_limit_s` to p99 inter-chunk gap over the lowest rate's, per router core busy then;
- N routers: delivered tokens/s against one router's, and the per-token cost with N;
- with N >= 2, membership convergence: a decode worker moved in the cluster's membership table
  (draining, then active, `--moves` times), the time until every router lists the move.
Must not assert anything: it reports (`bench/router_report.py` makes the tables and PNG).
"""

from __future__ import annotations

import asyncio
import os
import platform
import time
from typing import Any

from pdserve.bench.emulate import _cpu_s

TTFT_LIMIT_S = 0.010
ITL_LIMIT_S = 0.002
SHORT_TOKENS = 1  # the short-answer window's max_tokens: a request's cost with one token
OK_SHARE = 0.99  # a window counts as served when this share of its requests succeeded


def add_arguments(p):
    p.add_argument("--routers", default="1,2", help="router counts, comma-separated")
    p.add_argument("--rates", default="10,20,40,80,160",
                   help="requests per second, rising, comma-separated")
    p.add_argument("--window-s", type=float, default=8.0, help="seconds of arrivals per rate")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    p.add_argument("--api", default="http,grpc", help="http, grpc or both")
    p.add_argument("--decode-workers", type=int, default=4)
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--profile", default="h100-llama3-8b",
                   help="the emulated workers' step-time profile")
    p.add_argument("--moves", type=int, default=20,
                   help="membership moves timed with 2+ routers (0: none)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--out", default=None, help="write router.json, router.png, router.md here")
    p.add_argument("--model", default="", help="tokenizer and chat template (default: "
                                               "SmolLM2-135M)")
    return p


# ---- the figures (pure) --------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(rows: list, sent: int, dropped: int, wall_s: float, cpu_s: float,
              rate: float, max_tokens: int) -> dict[str, Any]:
    """One window's figures from its rows (`router_client.Row`) and the routers' CPU."""
    ok = [r for r in rows if r.ok]
    refused = [r for r in rows if r.status in ("429", "RESOURCE_EXHAUSTED")]
    errors = sorted({r.status for r in rows if not r.ok and r not in refused})
    tokens = sum(r.tokens for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    return {"rate_rps": rate, "max_tokens": max_tokens, "sent": sent, "dropped": dropped,
            "ok": len(ok), "refused": len(refused), "errors": errors[:3],
            "tokens": tokens, "wall_s": round(wall_s, 3),
            "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
            "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
            "gap_p50_s": _pct(gaps, 0.5), "gap_p99_s": _pct(gaps, 0.99),
            "router_cpu_s": round(cpu_s, 4),
            "router_cores": cpu_s / wall_s if wall_s > 0 else 0.0}


def costs(windows: list[dict[str, Any]]) -> dict[str, float] | None:
    """CPU microseconds per request and per token: least squares of router_cpu_s on
    (ok requests, tokens) over the windows (they must differ in tokens per request). None
    when the fit is undetermined."""
    sxx = sxy = syy = sxc = syc = 0.0
    for w in windows:
        x, y, c = float(w["ok"]), float(w["tokens"]), float(w["router_cpu_s"])
        sxx += x * x
        sxy += x * y
        syy += y * y
        sxc += x * c
        syc += y * c
    det = sxx * syy - sxy * sxy
    if det <= 1e-9 * max(1.0, sxx * syy):
        return None
    per_request = (sxc * syy - syc * sxy) / det
    per_token = (sxx * syc - sxy * sxc) / det
    return {"us_per_request": per_request * 1e6, "us_per_token": per_token * 1e6}


def per_core(cost: dict[str, float], tokens_per_request: int) -> dict[str, float]:
    """What one fully busy router core carries at `cost`, with answers this long."""
    request_s = max(1e-12, (cost["us_per_request"] + cost["us_per_token"] * tokens_per_request)
                    * 1e-6)
    return {"requests_per_s": 1.0 / request_s,
            "tokens_per_s": tokens_per_request / request_s,
            "tokens_per_s_tokens_only": 1e6 / max(1e-9, cost["us_per_token"])}


def served(w: dict[str, Any]) -> bool:
    return w["sent"] > 0 and w["ok"] >= OK_SHARE * w["sent"] and not w["dropped"]


def within_limits(windows: list[dict[str, Any]], ttft_limit_s: float = TTFT_LIMIT_S,
                  itl_limit_s: float = ITL_LIMIT_S) -> dict[str, Any] | None:
    """The highest-rate window that was served and whose p99 TTFT and p99 gap exceed the
    lowest rate's by at most the limits, with its rates per router core busy; None if even
    the lowest rate was not served."""
    rising = sorted((w for w in windows if w["ttft_p99_s"] is not None),
                    key=lambda w: w["rate_rps"])
    if not rising or not served(rising[0]):
        return None
    base = rising[0]
    best = base
    for w in rising[1:]:
        if (served(w) and w["ttft_p99_s"] - base["ttft_p99_s"] <= ttft_limit_s
                and (w["gap_p99_s"] or 0.0) - (base["gap_p99_s"] or 0.0) <= itl_limit_s):
            best = w
    cores = max(best["router_cores"], 1e-9)
    return {"rate_rps": best["rate_rps"], "requests_per_s": best["requests_per_s"],
            "tokens_per_s": best["tokens_per_s"], "router_cores": best["router_cores"],
            "requests_per_s_per_core": best["requests_per_s"] / cores,
            "tokens_per_s_per_core": best["tokens_per_s"] / cores,
            "added_ttft_p99_s": best["ttft_p99_s"] - base["ttft_p99_s"],
            "added_gap_p99_s": (best["gap_p99_s"] or 0.0) - (base["gap_p99_s"] or 0.0)}


def scaling(by_routers: dict[int, dict[str, Any]], api: str) -> list[dict[str, Any]]:
    """Per router count: the most tokens/s delivered in a served window, against N times one
    router's, and the per-token cost."""
    one = None
    out = []
    for n in sorted(by_routers):
        a = by_routers[n]["apis"].get(api)
        if a is None:
            continue
        best = max((w["tokens_per_s"] for w in a["windows"] if served(w)), default=0.0)
        if n == min(by_routers):
            one = best or None
        out.append({"routers": n, "tokens_per_s": best,
                    "vs_n_times_one": best / (n * one) if one else None,
                    "us_per_token": (a["cost"] or {}).get("us_per_token")})
    return out


# ---- the measurement -----------------------------------------------------------------------
def _prompts(n: int = 64) -> list[list[dict[str, str]]]:
    """Chat first turns from the ShareGPT package when installed, else short questions."""
    try:
        from pdserve.engine.prompts import load_sharegpt_prompts

        texts = load_sharegpt_prompts(n, seed=0, min_chars=16, max_chars=1000)
    except (ImportError, OSError, ValueError):  # the package is optional
        texts = [f"Question {i}: what should a person know about the number {i}?"
                 for i in range(n)]
    return [[{"role": "user", "content": t}] for t in texts]


def _routers_cpu(cluster) -> float:
    return sum(_cpu_s(c.proc.pid) for c in cluster.children
               if c.kind == "router" and c.proc.poll() is None)


def _window(cluster, api: str, model: str, prompts, rate: float, window_s: float,
            max_tokens: int, idle_cores: float) -> dict[str, Any]:
    from pdserve.bench.router_client import open_loop

    address = cluster.http_address if api == "http" else cluster.router_address
    c0, t0, client0 = _routers_cpu(cluster), time.monotonic(), time.process_time()
    out = asyncio.run(open_loop(api, address, model, prompts, rate, window_s, max_tokens,
                                seed=int(rate * 1000) + max_tokens))
    wall = time.monotonic() - t0
    cpu = _routers_cpu(cluster) - c0 - idle_cores * wall
    w = summarize(out["rows"], out["sent"], out["dropped"], out["wall_s"], max(0.0, cpu),
                  rate, max_tokens)
    # The load client shares the host: its own cores say when it, not a router, ran short.
    w["client_cores"] = (time.process_time() - client0) / wall
    return w


def _listed(control: str, address: str) -> int:
    from pdserve import rpc
    from pdserve.core.identity import ROUTER
    from pdserve.proto import router_pb2 as rpb
    from pdserve.proto import router_pb2_grpc as rpb_grpc

    with rpc.make_channel(control, ROUTER) as ch:
        got = rpb_grpc.RouterControlStub(ch).ListWorkers(rpb.ListWorkersRequest(), timeout=10)
    return next(m.state for m in got.workers if m.address == address)


def convergence(cluster, moves: int, timeout_s: float = 10.0) -> dict[str, Any]:
    """Seconds from a move in the membership table until every router lists it, per move."""
    from pdserve.controller.routers import Routers
    from pdserve.core.roles import ACTIVE, DECODE, DRAINING
    from pdserve.proto import router_pb2 as rpb

    target = cluster.worker_addresses(DECODE)[-1]
    routers = Routers(masters=cluster.store_address)
    seconds = []
    try:
        for i in range(moves):
            state, want = ((DRAINING, rpb.MEMBER_STATE_DRAINING) if i % 2 == 0
                           else (ACTIVE, rpb.MEMBER_STATE_ACTIVE))
            t0 = time.monotonic()
            routers.move(target, state, DECODE if state == ACTIVE else None, "bench router")
            for control in cluster.router_controls:
                while _listed(control, target) != want:
                    if time.monotonic() - t0 > timeout_s:
                        raise RuntimeError(f"router {control} did not list {target} {state} "
                                           f"within {timeout_s:g}s")
                    time.sleep(0.001)
            seconds.append(time.monotonic() - t0)
        if moves % 2:
            routers.move(target, ACTIVE, DECODE, "bench router")
    finally:
        routers.close()
    return {"moves": len(seconds), "p50_s": _pct(seconds, 0.5), "max_s": max(seconds)}


def measure(model: str, n: int, args, apis: list[str], rates: list[float],
            progress=lambda what: None) -> dict[str, Any]:
    import httpx

    from pdserve.launcher.local import ClusterSpec, LocalCluster

    spec = ClusterSpec(model_path=model, routers=n, prefill_workers=args.prefill_workers,
                       decode_workers=args.decode_workers, engine="emulated",
                       profile=args.profile, kv_scale=1 / 64, controller=False, http_port=0,
                       router_port=0, max_in_flight=100_000, max_predicted_ttft_s=0.0,
                       max_local_prefill_tokens=0, metrics_port=None)
    prompts = _prompts()
    with LocalCluster(spec) as cluster:
        served_model = httpx.get(f"http://{cluster.http_address}/v1/models",
                                 timeout=30).json()["data"][0]["id"]
        progress(f"{n} routers: warming up")
        for api in apis:
            _window(cluster, api, served_model, prompts, rates[0], 2.0, 8, 0.0)
        c0, t0 = _routers_cpu(cluster), time.monotonic()
        time.sleep(3.0)
        idle = (_routers_cpu(cluster) - c0) / (time.monotonic() - t0)
        result: dict[str, Any] = {"routers": n, "idle_cores": idle, "apis": {},
                                  "convergence": None}
        if n >= 2 and args.moves > 0:
            progress(f"{n} routers: membership convergence")
            result["convergence"] = convergence(cluster, args.moves)
        for api in apis:
            progress(f"{n} routers, {api}: short answers")
            short = _window(cluster, api, served_model, prompts, rates[0], args.window_s,
                            SHORT_TOKENS, idle)
            windows = []
            for rate in rates:
                progress(f"{n} routers, {api}: {rate:g} requests/s")
                w = _window(cluster, api, served_model, prompts, rate, args.window_s,
                            args.max_tokens, idle)
                windows.append(w)
                if not served(w):
                    break  # past what this host carries: higher rates say nothing more
            cost = costs([short, *windows])
            result["apis"][api] = {
                "short": short, "windows": windows, "cost": cost,
                "per_core": per_core(cost, args.max_tokens) if cost else None,
                "within_limits": within_limits(windows)}
    return result


def run_bench(model: str, args, progress=lambda what: None) -> dict[str, Any]:
    routers = [int(x) for x in args.routers.split(",") if x.strip()]
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    apis = ["http", "grpc"] if args.api.strip() == "both" else [
        a.strip() for a in args.api.split(",") if a.strip()]
    if not routers or min(routers) < 1:
        raise SystemExit("--routers: comma-separated counts >= 1")
    if not rates or min(rates) <= 0 or rates != sorted(rates):
        raise SystemExit("--rates: rising request rates > 0, comma-separated")
    if not apis or set(apis) - {"http", "grpc"}:
        raise SystemExit(f"--api: http, grpc, http,grpc or both, got {args.api!r}")
    started = time.monotonic()
    by_routers = {n: measure(model, n, args, apis, rates, progress) for n in routers}
    return {"bench": "router", "model": os.path.basename(model), "profile": args.profile,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "settings": {"window_s": args.window_s, "max_tokens": args.max_tokens,
                         "rates_rps": rates, "decode_workers": args.decode_workers,
                         "prefill_workers": args.prefill_workers,
                         "ttft_limit_s": TTFT_LIMIT_S, "itl_limit_s": ITL_LIMIT_S},
            "aims": {"tokens_per_s_per_core": 30_000, "requests_per_s_per_core": 100,
                     "scaling": 0.8},
            "runs": [by_routers[n] for n in routers],
            "scaling": {api: scaling(by_routers, api) for api in apis},
            "seconds": round(time.monotonic() - started, 1)}


def run(args) -> int:
    from rich.progress import Progress

    from pdserve.bench import router_report
    from pdserve.output import emit

    model = args.model
    if not model:
        from pdserve.engine.model_files import default_model_path
        model = default_model_path()
    with Progress(transient=True, disable=args.json) as bar:
        task = bar.add_task("starting", total=None)
        result = run_bench(model, args, lambda what: bar.update(task, description=what))
    return emit(result, json_out=args.json, out_dir=args.out,
                write_outputs=router_report.write_outputs,
                print_tables=router_report.print_tables)
