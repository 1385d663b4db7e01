"""vidur and pdserve sim on the same requests and the same per-operator numbers: one colocated
Llama-2-7B replica on an H100, no tensor or pipeline parallelism.

Owns the comparison: (1) running vidur (`python -m vidur.main` in its own virtual environment,
offline, on the hub cache and trace `vidur_inputs` writes) with a chunked-prefill scheduler set
like ours (sarathi: decodes first, then prefill chunks, 4,096 tokens and 128 sequences a step)
and reading its per-request metrics; (2) the pdserve profile derived from the same numbers
(vidur's profiled linear operators as the weight-read floor and per-token slope, no per-step
overhead since vidur models none, attention and KV from the roofline that also wrote vidur's
attention profile); (3) pdserve sim on a colocated cluster (`prefill_workers=0`) with the same
batch caps and KV blocks; (4) the table of mean/p50/p90 TTFT, ITL, e2e and their differences,
a PNG of the three distributions, one step's time from vidur's predictor and from our profiles
for the same batches (`vidur_steps`), and vidur's linear-operator times against our roofline's.
Must not download anything or copy vidur's code.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

from pdserve.core.stats import percentile
from pdserve.core.step_profile import StepProfile
from pdserve.sim.roofline import MODELS, roofline_profile
from pdserve.sim.trace import HASH_BLOCK_TOKENS, SimRequest
from pdserve.simtools.vidur_inputs import TRACE_DATE, attention_rows, write_hub_cache, write_trace_csv
from pdserve.simtools.vidur_steps import step_table

LINEAR_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
              "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
DEFAULT_VENV = "/work/venv-vidur"
DEFAULT_TRACE = "synthetic:poisson:rate=4,n=300,in=1024,out=128"
VIDUR_MODEL, VIDUR_DEVICE, VIDUR_NETWORK = "meta-llama/Llama-2-7b-hf", "h100", "h100_dgx"
COMPUTE_REPO, NETWORK_REPO = "pdserve-local/llama-2-7b-h100", "pdserve-local/h100-dgx"
MAX_TOKENS = 4096  # Llama-2-7B's context in vidur; prompt + output of every request fits
CHUNK_TOKENS, MAX_SEQS, BLOCK = 4096, 128, 16  # both schedulers' step caps, KV block tokens
METRICS = ("ttft_s", "itl_s", "e2e_s")
STATS = ("mean", "p50", "p90")


# ---- the pdserve profile from vidur's numbers -----------------------------------------------
def linear_times(mlp_csv: str, layers: int, embedding: bool = True) -> dict[int, float]:
    """Seconds of one step's linear operators (all layers, + the embedding) per token count,
    from vidur's `mlp.csv` rows with one tensor-parallel worker."""
    out = {}
    with open(mlp_csv, newline="") as f:
        for r in csv.DictReader(f):
            if r.get("num_tensor_parallel_workers", "1") != "1":
                continue
            ms = sum(float(r[f"time_stats.{op}.median"] or 0) for op in LINEAR_OPS) * layers
            if embedding:
                ms += float(r["time_stats.emb.median"])
            out[int(r["num_tokens"])] = ms / 1e3
    if not out:
        raise ValueError(f"{mlp_csv}: no rows with num_tensor_parallel_workers == 1")
    return dict(sorted(out.items()))


def vidur_profile(mlp_csv: str, gpu: str = "h100", model: str = "llama2-7b") -> StepProfile:
    """The roofline profile with vidur's linear operators (what vidur's simulation sums: every
    layer, no embedding or LM head) as the weight-read floor (1 token) and the per-token slope
    (over >= 512 tokens), and no per-step overhead (vidur models none)."""
    base = roofline_profile(gpu, model)
    t = linear_times(mlp_csv, MODELS[model].layers, embedding=False)
    big = [(n, s) for n, s in t.items() if n >= 512]
    slope = float(np.polyfit([n for n, _ in big], [s for _, s in big], 1)[0])
    return dataclasses.replace(
        base, origin=f"vidur-derived: linear ops from vidur's {os.path.basename(mlp_csv)} "
        f"({len(t)} token counts), no step overhead, attention and KV from the {base.origin}",
        overhead_s=0.0, prefill_token_s=slope, decode_seq_s=slope, weights_read_s=t[min(t)],
        fit={"method": "vidur mlp.csv: floor = 1-token time, slope over >= 512 tokens",
             "points": {str(n): s for n, s in t.items()}, "base": base.fit})


def linear_step_table(mlp_csv: str, gpu: str, model: str,
                      counts=(1, 16, 64, 256, 1024, 2048, 4096)) -> list[dict[str, float]]:
    """Per token count: vidur's measured linear time and the roofline's linear-only time."""
    p = roofline_profile(gpu, model)
    t = linear_times(mlp_csv, MODELS[model].layers)
    return [{"tokens": n, "vidur_s": t[n], "roofline_s": max(p.prefill_token_s * n,
                                                              p.weights_read_s),
             "roofline_over_vidur": max(p.prefill_token_s * n, p.weights_read_s) / t[n]}
            for n in counts if n in t]


# ---- the requests both take -----------------------------------------------------------------
def fit_requests(reqs: list[SimRequest], max_tokens: int = MAX_TOKENS
                 ) -> tuple[list[SimRequest], int]:
    """Requests whose prompt + output fit `max_tokens`, shortening the prompt (vidur's own rule
    for its trace replay); returns them and how many were shortened."""
    out, cut = [], 0
    for r in reqs:
        gen = min(r.output_tokens, max_tokens - 1)
        prompt = min(r.prompt_tokens, max_tokens - gen)
        if (prompt, gen) != (r.prompt_tokens, r.output_tokens):
            cut += 1
            r = dataclasses.replace(r, prompt_tokens=prompt, output_tokens=gen,
                                    block_hashes=r.block_hashes[:-(-prompt // HASH_BLOCK_TOKENS)])
        out.append(r)
    return out, cut


def dist(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p90": None}
    return {"n": len(values), "mean": sum(values) / len(values),
            "p50": percentile(values, 50), "p90": percentile(values, 90)}


# ---- vidur ----------------------------------------------------------------------------------
def vidur_args(workdir: str, trace_csv: str, kv_blocks: int, granularity: int = 256,
               trees: int = 100) -> list[str]:
    """vidur's command line: one replica, TP 1, PP 1, sarathi chunked prefill with our caps,
    our trace replayed as it is, its random-forest predictor on the local profiles (context
    looked up in steps of `granularity` tokens; 256 is vidur's default)."""
    rf = "--random_forrest_execution_time_predictor_config_"
    return [
        "--replica_config_model_name", VIDUR_MODEL, "--replica_config_device", VIDUR_DEVICE,
        "--replica_config_network_device", VIDUR_NETWORK, "--cluster_config_num_replicas", "1",
        "--replica_config_num_pipeline_stages", "1", "--replica_config_tensor_parallel_size", "1",
        "--cache_config_block_size", str(BLOCK), "--cache_config_num_blocks", str(kv_blocks),
        "--replica_scheduler_config_type", "sarathi",
        "--sarathi_scheduler_config_chunk_size", str(CHUNK_TOKENS),
        "--sarathi_scheduler_config_batch_size_cap", str(MAX_SEQS),
        "--request_generator_config_type", "trace_replay",
        "--trace_request_generator_config_trace_file", trace_csv,
        "--trace_request_generator_config_date", TRACE_DATE,
        "--trace_request_generator_config_max_tokens", str(MAX_TOKENS),
        *[a for k in ("prefill", "decode", "time") for a in
          (f"--trace_request_generator_config_{k}_scale_factor", "1")],
        "--execution_time_predictor_config_type", "random_forrest",
        f"{rf}model_profiling_dataset", COMPUTE_REPO,
        f"{rf}network_profiling_dataset", NETWORK_REPO,
        f"{rf}cache_dir", os.path.join(workdir, "predictor"),
        f"{rf}prediction_max_tokens_per_request", str(MAX_TOKENS),
        f"{rf}kv_cache_prediction_granularity", str(granularity),
        f"{rf}k_fold_cv_splits", "2", f"{rf}num_estimators", str(trees),
        f"{rf}max_depth", "32", f"{rf}min_samples_split", "2",
        "--metrics_config_output_dir", os.path.join(workdir, "metrics"),
        "--no-metrics_config_store_plots", "--no-metrics_config_enable_chrome_trace"]


def run_vidur(venv: str, workdir: str, reqs: list[SimRequest], mlp_csv: str,
              attention: StepProfile, kv_blocks: int, aligned: bool = False,
              timeout_s: float = 1800.0) -> dict[str, Any]:
    """Write vidur's inputs under `workdir`, run it offline, return its per-request metrics.
    `aligned`: context looked up in steps of 32 tokens, not 256, and the attention rows keyed
    by the context after the chunk, as vidur's simulator looks prefill attention up."""
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        raise FileNotFoundError(f"--vidur-venv: no {py} (python -m venv {venv} && "
                                f"{venv}/bin/pip install vidur)")
    m, granularity = MODELS["llama2-7b"], 32 if aligned else 256
    # vidur keys its cached models by configuration, not by the profiles' contents: start clean
    shutil.rmtree(os.path.join(workdir, "predictor"), ignore_errors=True)
    os.makedirs(workdir, exist_ok=True)
    write_hub_cache(os.path.join(workdir, "predictor"), COMPUTE_REPO, NETWORK_REPO,
                    model=VIDUR_MODEL, device=VIDUR_DEVICE, network_device=VIDUR_NETWORK,
                    mlp_csv=mlp_csv, attention=attention_rows(
                        attention, m.layers, m.hidden, m.heads, m.kv_heads, BLOCK, MAX_TOKENS,
                        granularity, kv_includes_chunk=aligned))
    trace_csv = os.path.join(workdir, "trace.csv")
    write_trace_csv(trace_csv, reqs)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env.pop("PYTHONPATH", None)
    # vidur's package has a `types` module: run it from workdir, not from its own folder
    cmd = [py, "-m", "vidur.main", *vidur_args(workdir, trace_csv, kv_blocks, granularity)]
    print(f"vidur: training its predictors and simulating {len(reqs)} requests",
          file=sys.stderr)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env,
                         cwd=workdir)
    with open(os.path.join(workdir, "vidur.log"), "w") as f:
        f.write(out.stdout + out.stderr)
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-8:])
        raise RuntimeError(f"vidur exited with {out.returncode}:\n{tail}")
    found = sorted(glob.glob(os.path.join(workdir, "metrics", "*", "request_metrics.csv")))
    if not found:
        raise RuntimeError(f"vidur wrote no request_metrics.csv under {workdir}/metrics")
    ver = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('vidur'))"],
                         capture_output=True, text=True, timeout=120, cwd=workdir, env=env)
    log = out.stdout + out.stderr
    mape = {ln.split("Trained model ")[1].split()[0]: float(ln.rsplit("(MEAP) ", 1)[1].rstrip("%"))
            for ln in log.splitlines() if "Trained model" in ln and "(MEAP)" in ln}
    return {"version": ver.stdout.strip(), "command": cmd[1:], "fit_mape_pct": mape,
            "granularity": granularity, "attention_keyed_after_chunk": aligned,
            **read_vidur_metrics(found[-1], len(reqs))}


def read_vidur_metrics(path: str, n: int | None = None) -> dict[str, Any]:
    """vidur's `request_metrics.csv`: TTFT (`prefill_e2e_time`), e2e (`request_e2e_time`) and
    ITL as ours is defined, (e2e - TTFT) / (decode tokens - 1), per request."""
    ttft, e2e, itl = [], [], []
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        a, b = float(r["prefill_e2e_time"]), float(r["request_e2e_time"])
        d = int(float(r["request_num_decode_tokens"]))
        ttft.append(a)
        e2e.append(b)
        if d >= 2:
            itl.append((b - a) / (d - 1))
    if n is not None and len(rows) != n:
        raise RuntimeError(f"{path}: {len(rows)} requests finished, {n} were sent")
    return {"finished": len(rows), "ttft_s": dist(ttft), "itl_s": dist(itl),
            "e2e_s": dist(e2e), "samples": {"ttft_s": ttft, "itl_s": itl, "e2e_s": e2e}}


# ---- pdserve sim ----------------------------------------------------------------------------
def simulate_pdserve(reqs: list[SimRequest], profile: StepProfile, kv_blocks: int
                     ) -> dict[str, Any]:
    """One colocated worker (no prefill worker: the decode worker prefills, chunked)."""
    from pdserve.sim.config import SimConfig
    from pdserve.sim.run import simulate

    cfg = SimConfig(prefill_workers=0, decode_workers=1, max_num_seqs=MAX_SEQS,
                    max_num_batched_tokens=CHUNK_TOKENS, block_size=BLOCK, kv_blocks=kv_blocks,
                    prefix_caching=False)
    rep = simulate(cfg, reqs, profile)
    done = [i for i, s in enumerate(rep.status) if s == "ok"]
    ttft = [rep.ttft_s[i] for i in done]
    e2e = [rep.end_s[i] - rep.arrival_s[i] for i in done]
    itl = [x for x in (rep.itl_s(i) for i in done) if x is not None]
    return {"finished": len(done), "ttft_s": dist(ttft), "itl_s": dist(itl),
            "e2e_s": dist(e2e), "samples": {"ttft_s": ttft, "itl_s": itl, "e2e_s": e2e},
            "profile": profile.origin}


def differences(runs: dict[str, dict], base: str = "vidur") -> dict[str, dict]:
    """(run - base) / base per metric and statistic, for every run but the base."""
    b = runs[base]
    return {name: {m: {s: (r[m][s] - b[m][s]) / b[m][s] for s in STATS if b[m][s]}
                   for m in METRICS} for name, r in runs.items() if name != base}


# ---- both on one trace ----------------------------------------------------------------------
def compare(mlp_csv: str, venv: str, trace: str, workdir: str, seed: int = 0,
            with_roofline: bool = True, aligned: bool = True) -> dict[str, Any]:
    from pdserve.sim.trace import load_trace

    reqs, cut = fit_requests(load_trace(trace, seed=seed))
    roof = roofline_profile("h100", "llama2-7b")
    kv_blocks = roof.kv_capacity_tokens // BLOCK
    vid = vidur_profile(mlp_csv)
    doc: dict[str, Any] = {
        "config": f"one colocated replica, {VIDUR_MODEL}, H100, TP 1, PP 1; chunked prefill "
                  f"{CHUNK_TOKENS} tokens/step, {MAX_SEQS} sequences, {kv_blocks} KV blocks of "
                  f"{BLOCK}", "trace": trace, "seed": seed, "requests": len(reqs),
        "prompts_shortened": cut, "mlp_csv": mlp_csv,
        "linear_steps": linear_step_table(mlp_csv, "h100", "llama2-7b"),
        "vidur_derived_profile": vid.to_dict()}
    runs = {"vidur": run_vidur(venv, os.path.join(workdir, "vidur"), reqs, mlp_csv, roof,
                               kv_blocks)}
    if aligned:
        runs["vidur aligned"] = run_vidur(
            venv, os.path.join(workdir, "vidur-aligned"), reqs, mlp_csv, roof, kv_blocks,
            aligned=True)
    print("pdserve sim: vidur-derived profile", file=sys.stderr)
    runs["pdserve vidur-ops"] = simulate_pdserve(reqs, vid, kv_blocks)
    if with_roofline:
        print("pdserve sim: roofline profile", file=sys.stderr)
        runs["pdserve roofline"] = simulate_pdserve(reqs, roof, kv_blocks)
    doc["runs"] = runs
    doc["difference_vs_vidur"] = differences(runs)
    print("one step: vidur's predictor and our profiles", file=sys.stderr)
    doc["steps"] = step_table(venv, {n: r for n, r in runs.items() if n.startswith("vidur")},
                              {"pdserve vidur-ops": vid, "pdserve roofline": roof}, workdir)
    return doc


def main(argv: list[str] | None = None) -> int:
    from pdserve.simtools.vidur_report import plot, print_report

    p = argparse.ArgumentParser(prog="python -m pdserve.simtools.vidur_compare")
    p.add_argument("--mlp-csv", required=True,
                   help="vidur's data/profiling/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv")
    p.add_argument("--vidur-venv", default=DEFAULT_VENV)
    p.add_argument("--trace", default=DEFAULT_TRACE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="vidur's inputs, cache and output "
                   "(default: a temporary folder)")
    p.add_argument("--no-roofline", action="store_true",
                   help="leave out pdserve sim with the plain roofline profile")
    p.add_argument("--no-aligned", action="store_true",
                   help="leave out the second vidur run (lookups in 32-token steps, prefill "
                        "attention keyed by the context after the chunk)")
    p.add_argument("--out", default="vidur_compare.json")
    p.add_argument("--png", default="vidur_compare.png")
    a = p.parse_args(argv)
    if not os.path.exists(a.mlp_csv):
        p.error(f"--mlp-csv: no file {a.mlp_csv}")
    work = a.workdir or tempfile.mkdtemp(prefix="vidur-compare-")
    os.makedirs(work, exist_ok=True)
    try:
        doc = compare(os.path.abspath(a.mlp_csv), a.vidur_venv, a.trace, os.path.abspath(work),
                      a.seed, not a.no_roofline, not a.no_aligned)
    except (FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    samples = {name: r.pop("samples") for name, r in doc["runs"].items()}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    print_report(doc)
    if a.png:
        plot(samples, doc, a.png)
        print(f"wrote {a.png}")
    print(f"wrote {a.out} (vidur's files: {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
