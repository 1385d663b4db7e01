"""`pdserve sim validate`: the same trace on a real CPU cluster and in the simulator, and how far
the simulator's latencies are from the measured ones.

Owns the comparison: one trace scaled for this machine (prompt lengths divided by one factor,
arrivals at a stated rate, outputs capped; all stated next to every figure), replayed open loop
on a fresh `pdserve serve`-style cluster per configuration (1P1D, 2P2D: the cluster start and
the streaming client of `pdserve bench serve`), then simulated with the CPU calibration on the
same requests (the same prompt sharing, arrivals the trace gives one time spaced alike on both
sides), its step constants and serving costs re-measured just before the real runs (a shared
machine's speed drifts between a calibration and a validation), and the relative error of
mean/p50/p90/p99 TTFT, ITL (per request, as AIPerf defines it) and end-to-end latency. Tables,
JSON and a PNG of both distributions. Must not tune the simulator to the cluster's measurement
or assert an error bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
import sys
import tempfile
import time
from typing import Any

from pdserve.core.errors import ConfigError
from pdserve.simtools.validate_compare import compare, rankings

DEFAULT_TRACE = "../shared/traces/mooncake_conversation_trace.jsonl"
TRACE_BLOCK_TOKENS = 512  # the trace's prefix granularity, before its prompts are scaled


class ValidateError(ConfigError):
    """A validation setting that cannot work; the message names the flag."""


def parse_routings(text: str) -> list[str]:
    from pdserve.router.policy import PREFILL_POLICIES

    out = [part.strip() for part in text.split(",") if part.strip()]
    bad = [x for x in out if x not in PREFILL_POLICIES]
    if bad or not out:
        raise ValidateError(f"--routing: {', '.join(bad) or 'nothing given'} is not one of "
                            f"{', '.join(PREFILL_POLICIES)}")
    if len(set(out)) != len(out):
        raise ValidateError("--routing: a policy is named twice")
    return out


def parse_configs(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        p, _, d = part.strip().lower().partition("p")
        if not d.endswith("d") or not p.isdigit() or not d[:-1].isdigit():
            raise ValidateError(f"--configs: {part!r} is not like 1p1d")
        out.append((int(p), int(d[:-1])))
    if any(p < 1 or d < 1 for p, d in out):
        raise ValidateError("--configs: every configuration needs a prefill and a decode worker")
    return out


# ---- the workload: one list of requests for both sides --------------------------------------
def prefix_block(s: dict[str, Any]) -> int:
    """The real prompts share whole blocks of the trace, scaled: the simulator's prefix ids
    stand for as many tokens each."""
    return TRACE_BLOCK_TOKENS // s["token_scale"]


def sim_blocks(prompts: list[list[int]], block: int) -> list[tuple[int, ...]]:
    """Prefix ids per `block` tokens, equal exactly when the tokens up to the end of that block
    are equal (a chained digest), numbered in order of first appearance."""
    ids: dict[bytes, int] = {}
    out = []
    for toks in prompts:
        h = hashlib.blake2b(digest_size=16)
        row = []
        for start in range(0, len(toks), block):
            h.update(json.dumps(toks[start:start + block]).encode())
            row.append(ids.setdefault(h.copy().digest(), len(ids)))
        out.append(tuple(row))
    return out


def shared_fraction(prompts: list[list[int]], block: int) -> float:
    """Share of prompt tokens in whole `block`-token blocks an earlier prompt already had."""
    seen: set[bytes] = set()
    hit = total = 0
    for toks in prompts:
        h = hashlib.blake2b(digest_size=16)
        total += len(toks)
        for start in range(0, len(toks) - block + 1, block):
            h.update(json.dumps(toks[start:start + block]).encode())
            d = h.copy().digest()
            hit += block if d in seen else 0
            seen.add(d)
    return hit / total if total else 0.0


def stagger(reqs: list, gap_s: float) -> list:
    """Requests the trace gives one arrival time, spaced `gap_s` apart in trace order (a later
    distinct time is kept unless the spacing reaches it). Without it the real client's threads
    race, and which of the simultaneous prompts the prefill worker meets first, and so which
    one it prefills alone, changes from run to run; the simulator takes them in trace order."""
    import dataclasses

    out, prev_t, prev_new = [], None, None
    for r in reqs:
        t = new = r.arrival_s
        if prev_t is not None and t is not None:
            if t <= prev_t:  # the same time as the one before: after it
                new = prev_new + gap_s
            elif prev_new > prev_t:  # a spaced group may have run past it
                new = max(t, prev_new + gap_s)
        prev_t, prev_new = t, new
        out.append(r if new == t else dataclasses.replace(r, arrival_s=new))
    return out


def workload(s: dict[str, Any], model: str):
    from pdserve.bench import serve_workload as wl
    from pdserve.engine.checkpoint_config import load_model_config
    from pdserve.sim.trace import SimRequest

    rows = wl.read_trace(s["trace"], s["requests"])
    span = rows[-1].arrival_s - rows[0].arrival_s
    trace_rate = (len(rows) - 1) / span if span > 0 else float(len(rows))
    speedup = s["rate"] / trace_rate
    vocab = load_model_config(model).vocab_size
    reqs = wl.trace_requests(s["trace"], s["requests"], s["max_tokens"],
                             token_scale=s["token_scale"], speedup=speedup,
                             vocab=(min(1000, vocab // 4), vocab),
                             max_prompt_tokens=s["max_prompt_tokens"], seed=s["seed"])
    reqs = stagger(reqs, s["stagger_ms"] / 1000.0)
    prompts = [list(r.body["prompt"]) for r in reqs]
    block = prefix_block(s)
    sims = [SimRequest(f"r{i}", r.arrival_s or 0.0, len(p), r.max_tokens, b)
            for i, (r, p, b) in enumerate(zip(reqs, prompts, sim_blocks(prompts, block)))]
    scale = {"token_scale": s["token_scale"], "arrival_speedup": speedup,
             "rate_rps": s["rate"], "max_tokens": s["max_tokens"],
             "stagger_ms": s["stagger_ms"],
             "max_prompt_tokens": s["max_prompt_tokens"], "requests": len(reqs),
             "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
             "shared_tokens_16": shared_fraction(prompts, 16),
             "prefix_block_tokens": block,
             "shared_tokens_prefix_block": shared_fraction(prompts, block)}
    return reqs, sims, scale


# ---- the two sides --------------------------------------------------------------------------
def _per_request(ttft: list[float], e2e: list[float], tokens: list[int]) -> dict[str, list]:
    itl = [(e - t) / (n - 1) for t, e, n in zip(ttft, e2e, tokens) if n > 1]
    return {"ttft_s": ttft, "itl_s": itl, "e2e_s": e2e}


class RunnableSampler:
    """Samples, `hz` times a second on a thread, the host's runnable threads (/proc/loadavg)
    less the workers' own runnable threads and the sampler: the other work the workers shared
    the cores with (the router, the store, the client, anything else on the machine). Each
    sample also says whether a worker was computing then (`busy`): the other work that
    competes with the workers' steps is what runs while they compute."""

    def __init__(self, worker_pids: list[int], hz: float = 5.0) -> None:
        import threading

        self.pids, self.period = worker_pids, 1.0 / hz
        self.samples: list[int] = []
        self.busy: list[bool] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    @staticmethod
    def _running(pid: int) -> int:
        n = 0
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    n += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except OSError:  # the process or a thread ended while being read: count what was read
            return n
        return n

    def _loop(self) -> None:
        while not self.stop.wait(self.period):
            with open("/proc/loadavg") as f:
                runnable = int(f.read().split()[3].split("/")[0])
            computing = sum(map(self._running, self.pids))
            self.samples.append(max(0, runnable - 1 - computing))
            self.busy.append(computing > 0)

    def __enter__(self) -> RunnableSampler:
        if os.path.exists("/proc/loadavg"):
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None

    def mean_busy(self) -> float | None:
        """The mean over the samples taken while a worker computed."""
        kept = [n for n, b in zip(self.samples, self.busy) if b]
        return sum(kept) / len(kept) if kept else None


def real_side(reqs, p: int, d: int, policy: str, model: str, s: dict[str, Any], say
              ) -> dict[str, Any]:
    from pdserve.bench import serve_client as client
    from pdserve.bench.serve import _model_name
    from pdserve.bench.serve_summary import completed
    from pdserve.launcher.cluster_spec import free_ports
    from pdserve.launcher.local import ClusterSpec, LocalCluster

    # Each worker on its own share of the cores, as the profile's `threads_per_worker` says:
    # the simulator does not model cores lent between the workers of a host. Conditional
    # disaggregation (a decode worker prefilling a prompt it caches) is off on both sides:
    # every prompt takes the prefill worker, whose model is what this compares.
    emulated = s.get("engine") == "emulated"
    spec = ClusterSpec(model_path=model, router_port=free_ports(1)[0], http_port=0,
                       prefill_workers=p, decode_workers=d, controller=False,
                       routing=policy, ready_timeout_s=600, share_cores=False,
                       max_local_prefill_tokens=0,
                       **(dict(engine="emulated", profile=s["emulated_profile"],
                               kv_scale=s["kv_scale"])
                          if emulated else {}))
    before = os.getloadavg()[0]  # the cluster's own start-up raises the 1-minute average
    say(f"{p}P{d}D {policy}: starting the cluster (load average {before:.2f})")
    with LocalCluster(spec) as cluster:
        name = _model_name(cluster.http_address)
        done = [0]

        def tick() -> None:
            done[0] += 1
            if done[0] % max(1, len(reqs) // 10) == 0:
                say(f"{p}P{d}D real: {done[0]}/{len(reqs)} requests done")
        load = os.getloadavg()[0]
        workers = [c.proc.pid for c in cluster.children if c.kind == "worker"]
        with RunnableSampler(workers) as other:
            rows, wall = client.run_open(cluster.http_address, name, reqs, s["timeout_s"], tick)
        threads = spec.worker_threads()
    ok = [r for r in rows if completed(r)]
    if not ok:
        raise RuntimeError(f"{p}P{d}D: no request completed: {rows[0]['error']}")
    return {"ok": len(ok), "failed": len(rows) - len(ok), "wall_s": wall,
            "loadavg_1m_before_cluster": before, "loadavg_1m_start": load,
            "other_runnable_threads": other.mean(),
            "other_runnable_threads_busy": other.mean_busy(),
            "busy_fraction": sum(other.busy) / len(other.busy) if other.busy else None,
            "loadavg_1m_end": os.getloadavg()[0],
            "threads_per_worker": threads,
            **_per_request([r["ttft_s"] for r in ok], [r["e2e_s"] for r in ok],
                           [r["output_tokens"] for r in ok])}


def background_of(s: dict[str, Any], real: dict[str, Any]) -> float:
    """Other work's threads on the host for the simulator: `--host-background`, where
    "measured" is the mean of the real run's other runnable threads (sampled during the run;
    in older records, the load average before its cluster started)."""
    text = s.get("host_background", "0")
    if text == "measured":
        measured = real.get("other_runnable_threads")
        if measured is None:
            measured = real.get("loadavg_1m_before_cluster", 0.0)
        return float(measured)
    return float(text)


def sim_side(sims, p: int, d: int, policy: str, profile, s: dict[str, Any],
             background: float = 0.0) -> dict[str, Any]:
    from pdserve.sim.config import SimConfig
    from pdserve.sim.run import simulate

    wph = s.get("workers_per_host")
    if s.get("engine") == "emulated":  # each emulated worker waits out its own steps
        wph = 0
    cfg = SimConfig(prefill_workers=p, decode_workers=d, prefill_policy=policy,
                    max_num_batched_tokens=s["max_num_batched_tokens"], max_num_seqs=64,
                    transport="shm", seed=s["seed"], max_local_prefill_tokens=0,
                    prefix_block_tokens=prefix_block(s),
                    workers_per_host=p + d if wph is None else wph or None,
                    host_background_threads=background)
    t0 = time.monotonic()
    rep = simulate(cfg, sims, profile)
    ok = [i for i, st in enumerate(rep.status) if st == "ok"]
    host = getattr(profile, "host_cores", None)
    return {"ok": len(ok), "failed": len(rep.status) - len(ok), "wall_s": time.monotonic() - t0,
            "workers_per_host": cfg.workers_per_host if host else None, "host_cores": host,
            "host_background_threads": background if host else None,
            **_per_request([rep.ttft_s[i] for i in ok],
                           [rep.end_s[i] - rep.arrival_s[i] for i in ok],
                           [rep.output_tokens[i] for i in ok])}


def profile_for(s: dict[str, Any], model: str, recorded_doc: dict[str, Any], say):
    """(the profile to simulate with, the profile as given): `--steps now`/`quick` re-measure
    the given profile's step constants on this machine (the engine alone; `now` also its
    serving costs on a 1P1D cluster) before the real runs, so both sides see the machine as it
    is; with `--real-from`, the constants recorded with that run are reused when it has them.
    `--steps profile`: the profile as given."""
    from pdserve.simtools.calibrate import STEPS_NOW, STEPS_QUICK, serving_now, steps_now
    from pdserve.core.step_profile import StepProfile, load_profile

    given = load_profile(s["profile"])
    if s.get("engine") == "emulated":  # the emulated engine is the profile: its KV scaled too
        given = load_profile(s["emulated_profile"])  # the one its workers run (slowed or not)
        scaled = dataclasses.replace(given, kv_bytes_per_token=max(
            1, round(given.kv_bytes_per_token * s["kv_scale"])))
        if s["steps"] == "profile":
            return scaled, scaled
        if recorded_doc.get("profile"):
            say("serving costs: those measured with the recorded run")
            return StepProfile.from_dict(recorded_doc["profile"]), scaled
        # The steps are the profile's; what this machine adds around them is measured.
        return serving_now(scaled, s["emulated_profile"], model, STEPS_NOW, s["kv_scale"],
                           say), scaled
    if s["steps"] == "profile":
        return given, given
    if recorded_doc.get("profile"):
        say("step constants: those re-measured with the recorded run")
        return StepProfile.from_dict(recorded_doc["profile"]), given
    plan = STEPS_QUICK if s["steps"] == "quick" else STEPS_NOW
    return steps_now(given, model, plan, say), given


def validate(s: dict[str, Any], say=lambda line: None) -> dict[str, Any]:
    from pdserve.engine.model_files import default_model_path

    model = s["model"] or default_model_path()
    recorded_doc: dict[str, Any] = {}
    if s.get("real_from"):  # the measured side of an earlier run on the same requests
        with open(s["real_from"]) as f:
            recorded_doc = json.load(f)
        # Its arrivals as they were sent (records from before the spacing: simultaneous).
        s = {**s, "stagger_ms": recorded_doc["scale"].get("stagger_ms", 0.0)}
    with tempfile.TemporaryDirectory(prefix="pdserve-validate-") as tmp:
        return _validate(_emulated_profile(s, tmp), model, recorded_doc, say)


def _emulated_profile(s: dict[str, Any], tmp: str) -> dict[str, Any]:
    """`s` with the profile the emulated workers run: the one named, or with `--slowdown` the
    same engine that much slower, written to a file they read."""
    from pdserve.core.step_profile import load_profile

    if s.get("engine") != "emulated" or s.get("slowdown", 1.0) == 1.0:
        return {**s, "emulated_profile": s["profile"]}
    path = os.path.join(tmp, "profile.json")
    load_profile(s["profile"]).slowed(s["slowdown"]).save(path)
    return {**s, "emulated_profile": path}


def _validate(s: dict[str, Any], model: str, recorded_doc: dict[str, Any], say
              ) -> dict[str, Any]:
    reqs, sims, scale = workload(s, model)
    say(f"{len(reqs)} requests, prompts / {scale['token_scale']} "
        f"(mean {scale['mean_prompt_tokens']:.0f} tokens), {s['rate']} req/s, "
        f"outputs <= {s['max_tokens']}")
    recorded = {r.get("label", r["config"]): r["real"] for r in recorded_doc.get("runs", [])}
    profile, given = profile_for(s, model, recorded_doc, say)
    runs = []
    for (p, d), policy in itertools.product(s["configs"], s["routings"]):
        label = f"{p}P{d}D" + (f" {policy}" if len(s["routings"]) > 1 else "")
        real = recorded.get(label) or real_side(reqs, p, d, policy, model, s, say)
        background = background_of(s, real)
        sim = sim_side(sims, p, d, policy, profile, s, background)
        cmp = compare(real, sim)
        say(f"{label}: TTFT mean real {cmp['ttft_s']['mean']['real']:.2f} s, sim "
            f"{cmp['ttft_s']['mean']['sim']:.2f} s")
        run = {"config": f"{p}P{d}D", "routing": policy, "label": label, "real": real,
               "sim": sim, "compare": cmp}
        if profile is not given:  # what the profile's own step constants would have said
            run["compare_given"] = compare(
                real, sim_side(sims, p, d, policy, given, s, background))
        runs.append(run)
    return {"settings": {k: v for k, v in s.items() if k not in ("configs", "emulated_profile")},
            "configs": [f"{p}P{d}D" for p, d in s["configs"]], "scale": scale,
            "profile_origin": profile.origin, "given_profile_origin": given.origin,
            "profile": profile.to_dict(), "runs": runs, "rankings": rankings(runs)}


# ---- CLI ------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake .jsonl or Azure .csv")
    p.add_argument("--scale", type=int, default=32, dest="token_scale",
                   help="prompt lengths divided by this (a divisor of 512; default 32)")
    p.add_argument("--requests", type=int, default=24, help="the trace's first N (default 24)")
    p.add_argument("--rate", type=float, default=0.2,
                   help="arrivals per second after scaling (default 0.2)")
    p.add_argument("--max-tokens", type=int, default=32, help="output cap (default 32)")
    p.add_argument("--stagger-ms", type=float, default=20.0,
                   help="requests the trace gives one arrival time are spaced this far apart, "
                        "in trace order, on both sides (default 20; 0: simultaneous)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--configs", default="1p1d,2p2d", help="clusters to run (default 1p1d,2p2d)")
    p.add_argument("--profile", default="cpu-smollm2-135m",
                   help="the simulator's profile (default: the shipped CPU calibration)")
    p.add_argument("--steps", choices=("now", "quick", "profile"), default="now",
                   help="the profile's step constants and serving costs: re-measured on this "
                        "machine before the real runs (now: about a minute, the serving costs on "
                        "a 1P1D cluster; quick: fewer points, the constants only), or the "
                        "profile's own (default now)")
    p.add_argument("--model", default=None, help="model path (default SmolLM2-135M GGUF)")
    p.add_argument("--routing", default="kv_aware",
                   help="prefill routing on both sides; several, comma-separated, run each "
                        "configuration with each, and their ranking is compared (default "
                        "kv_aware)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="validate_out", help="folder for validate.json/.png")
    p.add_argument("--real-from", default=None,
                   help="validate.json of an earlier run with the same settings: reuse its "
                        "measured side, simulate again (e.g. with a new profile)")
    p.add_argument("--workers-per-host", type=int, default=None,
                   help="simulated workers sharing one host's cores, for a profile that says "
                        "host_cores (default: all, the one machine the real cluster runs on; "
                        "0: each worker alone)")
    p.add_argument("--host-background", default="0",
                   help="other work's threads on the simulated host: a number, or 'measured' "
                        "(the real run's other runnable threads, sampled during it; default 0)")
    p.add_argument("--engine", choices=("model", "emulated"), default="model",
                   help="the real cluster's engine: the model's weights (default), or emulated "
                        "workers running --profile (`pdserve emulate`): a check of the "
                        "simulator's cluster model at sizes the machine cannot compute")
    p.add_argument("--kv-scale", type=float, default=1 / 64,
                   help="with --engine emulated: KV bytes per token as a fraction of the "
                        "profile's, on both sides (default 1/64)")
    p.add_argument("--slowdown", type=float, default=1.0,
                   help="with --engine emulated: every modelled step this many times as long "
                        "on both sides (the profile's engine, slower), so this machine can "
                        "load a large cluster at the arrivals it can send (default 1)")
    p.add_argument("--json", action="store_true", help="print the JSON document")
    return p


def settings_from_args(a: argparse.Namespace) -> dict[str, Any]:
    from pdserve.worker.config import STEP_TOKENS  # the real CPU workers' step budget

    for name in ("requests", "max_tokens", "max_prompt_tokens", "token_scale"):
        if getattr(a, name) < 1:
            raise ValidateError(f"--{name.replace('_', '-')} must be >= 1")
    if 512 % a.token_scale:
        raise ValidateError(f"--scale must divide 512, got {a.token_scale}")
    if a.workers_per_host is not None and a.workers_per_host < 0:
        raise ValidateError("--workers-per-host must be >= 0")
    if a.host_background != "measured":
        try:
            ok = float(a.host_background) >= 0
        except ValueError:
            ok = False
        if not ok:
            raise ValidateError("--host-background must be a number >= 0 or 'measured', got "
                                f"{a.host_background!r}")
    if not a.rate > 0:
        raise ValidateError("--rate must be > 0")
    if not (a.slowdown >= 1 and a.slowdown < 1e6):
        raise ValidateError(f"--slowdown must be >= 1, got {a.slowdown}")
    if a.slowdown != 1 and a.engine != "emulated":
        raise ValidateError("--slowdown needs --engine emulated (a real engine's steps take "
                            "what they take)")
    if not 0 < a.kv_scale <= 1:
        raise ValidateError(f"--kv-scale must be in (0, 1], got {a.kv_scale}")
    if not 0 <= a.stagger_ms < 10_000:
        raise ValidateError(f"--stagger-ms must be >= 0 and < 10000, got {a.stagger_ms}")
    if not os.path.isfile(a.trace):
        raise ValidateError(f"--trace: no such file: {a.trace}")
    return {"trace": a.trace, "token_scale": a.token_scale, "requests": a.requests,
            "rate": a.rate, "max_tokens": a.max_tokens, "max_prompt_tokens": a.max_prompt_tokens,
            "stagger_ms": a.stagger_ms,
            "configs": parse_configs(a.configs), "profile": a.profile, "steps": a.steps,
            "model": a.model,
            "routings": parse_routings(a.routing), "timeout_s": a.timeout_s,
            "seed": a.seed, "max_num_batched_tokens": STEP_TOKENS["cpu"], "real_from": a.real_from,
            "workers_per_host": a.workers_per_host, "host_background": a.host_background,
            "engine": a.engine, "kv_scale": a.kv_scale, "slowdown": a.slowdown}


def run(args: argparse.Namespace) -> int:
    from pdserve.sim.plan import run_command
    from pdserve.simtools.validate_report import print_table, write_outputs

    return run_command(args, "validate", settings_from_args, validate, (ValidateError,),
                       write_outputs, print_table)


def main(argv: list[str] | None = None) -> int:
    return run(add_arguments(argparse.ArgumentParser(prog="pdserve sim validate"))
               .parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
