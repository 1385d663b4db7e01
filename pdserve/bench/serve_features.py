"""`pdserve bench serve --workload structured|tools|n4`: what one serving feature costs.

Owns the feature workloads and their run. Each sends the same ShareGPT chats (greedy, streamed,
`ignore_eos`: exactly `max_tokens` tokens each) without the feature and with it, in alternating
passes on one cluster (`serve_features_summary.pass_order`), every level of every pass with
fresh cache salts so no pass reuses another's prompt KV:
- `structured`: with `response_format` json_schema (strict), one schema for every request
  (compiled at the first, then cached); its array needs more items than `max_tokens` tokens
  can write, so the output stays inside the grammar to the last token;
- `tools`: with three functions and `tool_choice` naming one (the server forces a valid call
  with a grammar); its arguments are built to run as long, and the tools add prompt tokens;
- `n4`: with `n` = 4 choices, against one; the workers' counters say how often the prompt was
  prefilled and how much of it the choices share (`serve_features_summary.choices_kv`).
The cluster is started as `pdserve serve` starts it (the flags of `pdserve bench serve`);
before the passes one request of each variant must succeed, so a refused feature stops the run
at once with the server's answer. The result is one JSON document (`serve_features_report`
prints it and draws the PNG). Must not retry a request or tune the cluster beyond its flags.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from pdserve.bench import serve_features_summary as fsum

if TYPE_CHECKING:
    from pdserve.bench.serve import ServeBenchSettings
    from pdserve.bench.serve_workload import Request

FEATURES = ("structured", "tools", "n4")
REQUESTS = 16  # the feature workloads' defaults: short enough for a few minutes on 2 cores
CONCURRENCY = (1, 32)
PAIRS = 2
CHOICES = 4
MIN_ITEMS = 1000  # an item is at least its two keys: no output of <= MAX_TOKENS tokens completes
MAX_TOKENS = 2000
Ui = Callable[..., None]

_ITEM = {"type": "object", "additionalProperties": False, "required": ["name", "score"],
         "properties": {"name": {"type": "string", "maxLength": 24},
                        "score": {"type": "integer", "minimum": 0, "maximum": 100}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["topic", "items"],
          "properties": {"topic": {"type": "string", "maxLength": 60},
                         "items": {"type": "array", "minItems": MIN_ITEMS, "items": _ITEM}}}


def _function(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description, "strict": True,
        "parameters": {"type": "object", "additionalProperties": False,
                       "required": list(properties), "properties": properties}}}


TOOLS = [
    _function("get_weather", "Current weather in a city.",
              {"city": {"type": "string", "maxLength": 40},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}),
    _function("search_docs", "Search the documentation.",
              {"query": {"type": "string", "maxLength": 80},
               "max_results": {"type": "integer", "minimum": 1, "maximum": 20}}),
    _function("record_findings", "Record what the conversation found, item by item.",
              SCHEMA["properties"]),
]
FORCED_TOOL = "record_findings"

DESCRIPTIONS = {
    "structured": f"response_format json_schema (strict; an array of at least {MIN_ITEMS} "
                  f"objects, the same schema for every request)",
    "tools": f"{len(TOOLS)} tools, tool_choice {FORCED_TOOL} (its arguments an array of at "
             f"least {MIN_ITEMS} objects)",
    "n4": f"n = {CHOICES} choices (greedy)",
}


# ---- the workloads, as data -----------------------------------------------------------------
def with_feature(workload: str, req: Request, n: int = CHOICES) -> Request:
    """`req` with the feature: its body's extra fields; with n choices it expects n times the
    tokens (the usage counts every choice's)."""
    from pdserve.bench.serve_workload import Request

    if workload == "structured":
        extra: dict[str, Any] = {"response_format": {"type": "json_schema", "json_schema": {
            "name": "findings", "schema": SCHEMA, "strict": True}}}
    elif workload == "tools":
        extra = {"tools": TOOLS,
                 "tool_choice": {"type": "function", "function": {"name": FORCED_TOOL}}}
    elif workload == "n4":
        return Request(req.path, {**req.body, "n": n}, req.max_tokens * n, req.arrival_s)
    else:
        raise ValueError(f"unknown feature workload {workload!r}; one of {FEATURES}")
    return Request(req.path, {**req.body, **extra}, req.max_tokens, req.arrival_s)


def salted(reqs: list[Request], tag: str) -> list[Request]:
    """The requests with cache salts of their own (`tag` and each one's index): no request
    shares prompt KV with one sent before it, so every prompt is prefilled afresh."""
    from pdserve.bench.serve_workload import Request

    return [Request(r.path, {**r.body, "cache_salt": f"bench-serve-{tag}-{i}"}, r.max_tokens,
                    r.arrival_s) for i, r in enumerate(reqs)]


@dataclass(frozen=True)
class FeatureSettings:
    serve: ServeBenchSettings  # the cluster, the prompts, the levels
    workload: str
    pairs: int = PAIRS
    choices: int = CHOICES

    def __post_init__(self) -> None:
        s = self.serve
        if self.workload not in FEATURES:
            raise ValueError(f"--workload must be sharegpt or one of {', '.join(FEATURES)}, "
                             f"got {self.workload!r}")
        if self.pairs < 1:
            raise ValueError(f"--feature-pairs must be >= 1, got {self.pairs}")
        for flag, set_ in (("--trace", s.trace), ("--vllm-python", s.vllm_python),
                           ("--llamacpp-python", s.llamacpp_python)):
            if set_:
                raise ValueError(f"{flag} does not apply to --workload {self.workload} (it "
                                 f"measures pdserve with the feature against without)")
        if s.internal_tls == "both":
            raise ValueError(f"--internal-tls both does not apply to --workload "
                             f"{self.workload}: choose on or off")
        if self.workload != "n4" and s.max_tokens > MAX_TOKENS:
            raise ValueError(f"--max-tokens must be <= {MAX_TOKENS} with --workload "
                             f"{self.workload} (the grammar's output must not complete "
                             f"early), got {s.max_tokens}")


class FeatureRefused(RuntimeError):
    """The server refused or failed a request of one variant before any pass ran."""


# ---- the run --------------------------------------------------------------------------------
def run_pass(cluster, model: str, reqs: list[Request], levels: list[int],
             s: ServeBenchSettings, ui: Ui, label: str, tag: str) -> list[dict[str, Any]]:
    """Every level of one pass: its figures (`serve_summary.level_figures`), the workers'
    counters and the processes' CPU seconds over it, and the usage's prompt tokens."""
    from pdserve.bench import serve_client as client
    from pdserve.bench.serve_probe import cpu_diff, cpu_seconds, scrape
    from pdserve.bench.serve_summary import level_figures

    def procs() -> dict[str, int]:
        return {c.name: c.proc.pid for c in cluster.children}
    out = []
    mark, cpu_mark = scrape(cluster), cpu_seconds(procs())
    for c in levels:
        what, done = f"{label}: concurrency {c}", [0]
        load = os.getloadavg()[0]
        ui(what, 0, len(reqs))

        def tick() -> None:
            done[0] += 1
            ui(what, done[0], len(reqs))
        rows, wall = client.run_closed(cluster.http_address, model, salted(reqs, f"{tag}-c{c}"),
                                       c, s.request_timeout_s, tick)
        if wall <= 0:
            raise RuntimeError(f"{label}: no request of level {c} ran")
        fig = level_figures(rows, wall)
        now, cpu_now = scrape(cluster), cpu_seconds(procs())
        fig.update(concurrency=c, batch_size=min(c, len(reqs)), loadavg_1m_start=load,
                   cpu_s=cpu_diff(cpu_mark, cpu_now), counters=fsum.worker_counters(mark, now),
                   prompt_tokens_each=[r["prompt_tokens"] for r in rows
                                       if r["prompt_tokens"] is not None])
        out.append(fig)
        mark, cpu_mark = now, cpu_now
    return out


def _probe(address: str, model: str, variants: dict[str, list[Request]], workload: str,
           s: ServeBenchSettings, ui: Ui) -> None:
    """One request of each variant (fresh salts); the first failure stops the run."""
    from pdserve.bench.serve_client import stream_one

    for v, reqs in variants.items():
        ui(f"{workload}: a first request {v} the feature", 0, 1)
        [req] = salted(reqs[:1], f"{workload}-probe-{v}")
        row = stream_one(address, req, model, s.request_timeout_s)
        if row["error"]:
            raise FeatureRefused(f"--workload {workload}: the first request {v} the feature "
                                 f"({DESCRIPTIONS[workload]}) failed: {row['error']}")


def run_features(fs: FeatureSettings, out_dir: str | None, ui: Ui) -> dict[str, Any]:
    import json
    import tempfile

    from pdserve.bench import serve
    from pdserve.bench import serve_workload as wl
    from pdserve.bench.serve_probe import get_text, tree_rss_bytes
    from pdserve.engine.tokenizer import Tokenizer

    s, started, load_start = fs.serve, time.monotonic(), os.getloadavg()[0]
    model = s.model_path
    if not model:
        from pdserve.engine.loader import default_model_path
        model = default_model_path()
    if out_dir:  # a fresh folder per run: the store master refuses another cluster's journal
        os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    log_dir = tempfile.mkdtemp(prefix=time.strftime(f"run-{fs.workload}-%Y%m%d-%H%M%S-"),
                               dir=os.path.join(out_dir, "logs") if out_dir else None)
    base = wl.sharegpt_requests(s.requests, s.max_tokens, s.seed, s.min_prompt_chars,
                                s.max_prompt_chars)
    variants = {fsum.WITHOUT: base,
                fsum.WITH: [with_feature(fs.workload, r, fs.choices) for r in base]}
    tok = Tokenizer.from_path(model)
    lengths = [len(wl.prompt_ids(r, tok)) for r in base]
    order, levels = fsum.pass_order(fs.pairs), list(s.concurrency)
    spec = serve.cluster_spec(s, model, log_dir, s.internal_tls)
    with serve.started(spec, fs.workload, ui) as (cluster, start_s, cmdlines):
        name = json.loads(get_text(f"http://{cluster.http_address}/v1/models"))["data"][0]["id"]
        _probe(cluster.http_address, name, variants, fs.workload, s, ui)
        passes = []
        for i, v in enumerate(order):
            label = f"{fs.workload} pass {i + 1}/{len(order)}, {v} the feature"
            passes.append({"variant": v, "levels": run_pass(
                cluster, name, variants[v], levels, s, ui, label, f"{fs.workload}-{i + 1}")})
        rss = tree_rss_bytes([c.proc.pid for c in cluster.children])
        ui(f"{fs.workload}: stopping the cluster", 0, 1)
    rows = fsum.compare(passes)
    result: dict[str, Any] = {
        "bench": "serve", "model": os.path.basename(model.rstrip("/")) + (
            "" if s.quantization == "none" else f" ({s.quantization} weights)"),
        "model_path": model,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "python": platform.python_version(), "loadavg_1m_start": load_start,
                    "loadavg_1m_end": os.getloadavg()[0]},
        "settings": {"workload": fs.workload, "feature_pairs": fs.pairs,
                     **({"choices": fs.choices} if fs.workload == "n4" else {}),
                     **{k: getattr(s, k) for k in SETTINGS}, "model_path": model,
                     "concurrency": levels},
        "workload": {"name": fs.workload, "source": "sharegpt", "feature":
                     DESCRIPTIONS[fs.workload],
                     "fields": {k: v for k, v in variants[fsum.WITH][0].body.items()
                                if k not in base[0].body},
                     "requests": len(base), "levels": levels, "order": order,
                     "max_tokens": s.max_tokens,
                     "prompt_tokens_mean": sum(lengths) / len(lengths),
                     "prompt_tokens_min": min(lengths), "prompt_tokens_max": max(lengths),
                     "sampling": "temperature 0, ignore_eos, streamed with usage; a fresh "
                                 "cache_salt per request of every level of every pass"},
        "cluster": {"start_s": start_s, "rss_bytes": rss, "cmdlines": cmdlines,
                    "config": {"prefill_workers": spec.prefill_workers,
                               "decode_workers": spec.decode_workers,
                               "threads_per_worker": spec.worker_threads(),
                               "share_cores": spec.share_cores,
                               "controller": spec.controller,
                               "block_size_tokens": spec.block_size_tokens,
                               "internal_tls": s.internal_tls}},
        "passes": passes, "by_level": rows,
        "log_dir": log_dir, "seconds": time.monotonic() - started}
    result.update(_findings(fs, rows, passes, spec.block_size_tokens))
    return result


SETTINGS = ("requests", "max_tokens", "min_prompt_chars", "max_prompt_chars", "seed",
            "prefill_workers", "decode_workers", "threads_per_worker", "quantization",
            "share_cores", "core_sharing", "decode_streams", "controller",
            "max_predicted_ttft_s", "max_local_prefill_tokens", "internal_tls")


def _findings(fs: FeatureSettings, rows, passes, block_size: int) -> dict[str, Any]:
    """The workload's aims and notes (and, for n choices, its KV figures)."""
    notes = []
    if fs.workload == "n4":
        kv = fsum.choices_kv(passes, fs.choices, block_size)
        notes.append("output tokens/s counts every choice's tokens; TTFT is the first chunk "
                     "of any choice (ITL and TPOT mix the choices' chunks: not compared)")
        w, wo = kv[fsum.WITH], kv[fsum.WITHOUT]
        moved = {v: x for v, x in ((f"n={fs.choices}", wo["computed"] - w["prefill"]),
                                   ("n=1", wo["decode"])) if x is not None and x >= 0.5}
        if moved:
            notes.append("decode workers computed part of the requests' own prompts (prefill "
                         "moved onto them by the controller or the router): " + ", ".join(
                             f"{x:.1f} tokens per request with {v}" for v, x in moved.items())
                         + "; the followers' tail counts both roles, so it is not affected")
        if w["roles_changed"] or wo["roles_changed"]:
            notes.append("a worker changed role during a level: its counters are split by "
                         "the role at the level's end")
        return {"choices": kv, "aims": fsum.choices_aims(kv), "notes": notes}
    if fs.workload == "tools":
        w, wo = (sum(r[v]["prompt_tokens_mean"] or 0 for r in rows) / len(rows)
                 for v in (fsum.WITH, fsum.WITHOUT))
        notes.append(f"the tools add prompt tokens: {wo:.0f} without, {w:.0f} with (mean, "
                     f"from the usage); the TTFT difference includes prefilling them")
        notes.append("the aims are structured outputs' (a forced call is masked by a grammar "
                     "too); the extra prompt tokens count against both")
    else:
        notes.append("the schema is the same for every request: compiled at the first "
                     "request (before the passes), so the TTFT difference is the cost of a "
                     "cached schema")
    return {"aims": fsum.speed_aims(rows, "with"), "notes": notes}


# ---- CLI ------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=("sharegpt", *FEATURES), default="sharegpt",
                   help="sharegpt: the serving path against its ceiling (the default). "
                        "structured, tools, n4: the same ShareGPT chats without and with a "
                        "feature (response_format json_schema; a forced tool call; n=4 "
                        "choices), in alternating passes on one cluster, compared (tokens/s, "
                        f"TTFT; for n4 the prefills and KV blocks); defaults {REQUESTS} "
                        f"requests, concurrency {','.join(map(str, CONCURRENCY))}")
    p.add_argument("--feature-pairs", type=int, default=None,
                   help=f"with a feature workload: pairs of passes without/with, the order "
                        f"flipped every pair (without, with, with, without, ...; default "
                        f"{PAIRS})")


def settings_from(args: argparse.Namespace, serve: ServeBenchSettings) -> FeatureSettings:
    pairs = PAIRS if args.feature_pairs is None else args.feature_pairs
    return FeatureSettings(serve=serve, workload=args.workload, pairs=pairs)


def defaults(workload: str) -> dict[str, Any]:
    """The `--requests` and `--concurrency` a workload takes when they are not given."""
    return {} if workload == "sharegpt" else {"requests": REQUESTS, "concurrency": CONCURRENCY}


def check_sharegpt(args: argparse.Namespace) -> None:
    if args.workload == "sharegpt" and args.feature_pairs is not None:
        raise ValueError("--feature-pairs applies to --workload structured, tools or n4")
