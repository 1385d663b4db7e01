"""vidur beside pdserve sim: what vidur needs to run here, and how far our roofline is from vidur's
profiled numbers on a configuration both can express (one colocated Llama-2-7B replica on an
H100, no tensor parallelism).

Owns three things: (1) running vidur (`python -m vidur.main` in its own virtual environment) and
recording exactly why it stops when it does; (2) a `StepProfile` derived from vidur's profiled
per-layer linear-operator times (`mlp.csv` of vidur's repository: one row per token count),
keeping the roofline's attention and KV terms where vidur's attention profile is not available;
(3) the comparison: per-step linear time, vidur's numbers against our roofline, and the same
trace simulated by pdserve sim with each profile (a colocated replica: `prefill_workers=0`).
Must not download anything (vidur fetches its profiles from the Hugging Face hub; this module
never does) or copy vidur's code.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

from pdserve.sim.profile import StepProfile
from pdserve.sim.roofline import MODELS, roofline_profile

LINEAR_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
              "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
DEFAULT_VENV = "/work/venv-vidur"
DEFAULT_TRACE = "synthetic:poisson:rate=4,n=300,in=1024,out=128"


# ---- vidur itself ---------------------------------------------------------------------------
def run_vidur(venv: str, requests: int = 16, timeout_s: float = 600.0) -> dict[str, Any]:
    """Try vidur's own simulator (Llama-3-8B on H100, its documented default) offline."""
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        return {"ran": False, "why": f"no virtual environment at {venv} (python -m venv {venv} "
                "&& {venv}/bin/pip install vidur)"}
    ver = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('vidur'))"],
                         capture_output=True, text=True, timeout=120)
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([py, "-m", "vidur.main",
                          "--synthetic_request_generator_config_num_requests", str(requests)],
                         capture_output=True, text=True, timeout=timeout_s, env=env,
                         cwd=os.path.join(venv, ".."))
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    why = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1:])
    return {"ran": out.returncode == 0, "version": ver.stdout.strip() or None,
            "returncode": out.returncode,
            "why": None if out.returncode == 0 else (why if isinstance(why, str) else str(why)),
            "needs": ["Hugging Face dataset project-vajra/dev-staging-meta-llama-llama-3-8b-h100 "
                      "(compute profile: mlp.csv.xz, attention.csv.xz)",
                      "Hugging Face dataset project-vajra/dev-staging-h100-dgx (network "
                      "profile: all_reduce.csv.xz, send_recv.csv.xz)"],
            "wheel_ships_profiles": False}


# ---- a profile from vidur's numbers ---------------------------------------------------------
def linear_times(mlp_csv: str, layers: int) -> dict[int, float]:
    """Seconds of one step's linear operators (all layers + embedding) per token count, TP 1."""
    out = {}
    with open(mlp_csv, newline="") as f:
        for r in csv.DictReader(f):
            if r.get("num_tensor_parallel_workers", "1") != "1":
                continue
            per_layer = sum(float(r[f"time_stats.{op}.median"]) for op in LINEAR_OPS)
            ms = per_layer * layers + float(r["time_stats.emb.median"])
            out[int(r["num_tokens"])] = ms / 1e3
    if not out:
        raise ValueError(f"{mlp_csv}: no rows with num_tensor_parallel_workers == 1")
    return dict(sorted(out.items()))


def vidur_profile(mlp_csv: str, gpu: str = "h100", model: str = "llama2-7b") -> StepProfile:
    """The roofline profile with its linear-operator terms replaced by vidur's: the one-token
    time as the weight-read floor, the slope over large token counts as the per-token cost."""
    base = roofline_profile(gpu, model)
    t = linear_times(mlp_csv, MODELS[model].layers)
    big = [(n, s) for n, s in t.items() if n >= 512]
    slope = float(np.polyfit([n for n, _ in big], [s for _, s in big], 1)[0])
    floor = t[min(t)]
    return dataclasses.replace(
        base, origin=f"vidur-derived: linear ops from vidur's {os.path.basename(mlp_csv)} "
        f"({len(t)} token counts), attention and KV terms from the {base.origin}",
        prefill_token_s=slope, decode_seq_s=slope, weights_read_s=floor,
        fit={"method": "vidur mlp.csv: floor = 1-token time, slope over >= 512 tokens",
             "points": {str(n): s for n, s in t.items()}, "base": base.fit})


def linear_step_table(mlp_csv: str, gpu: str, model: str,
                      counts=(1, 16, 64, 256, 1024, 2048, 4096)) -> list[dict[str, float]]:
    """Per token count: vidur's measured linear time and the roofline's linear-only time."""
    p = roofline_profile(gpu, model)
    t = linear_times(mlp_csv, MODELS[model].layers)
    rows = []
    for n in counts:
        if n not in t:
            continue
        roof = max(p.prefill_token_s * n, p.weights_read_s)
        rows.append({"tokens": n, "vidur_s": t[n], "roofline_s": roof,
                     "roofline_over_vidur": roof / t[n]})
    return rows


# ---- the simulated comparison ---------------------------------------------------------------
def simulate_both(trace: str, profiles: dict[str, StepProfile], seed: int = 0) -> dict[str, Any]:
    from pdserve.sim.config import SimConfig
    from pdserve.sim.run import simulate
    from pdserve.sim.trace import load_trace

    reqs = load_trace(trace, seed=seed)
    out: dict[str, Any] = {}
    for p in (0, 1):  # colocated if the simulator serves it, else one prefill + one decode
        cfg = SimConfig(prefill_workers=p, decode_workers=1, seed=seed)
        for name, prof in profiles.items():
            sm = simulate(cfg, reqs, prof).summary()
            out[name] = {m: sm[m] for m in ("ttft_s", "itl_s", "e2e_s", "throughput_rps",
                                            "finished", "rejected")}
        out["cluster"] = "colocated (0P1D)" if p == 0 else \
            "1P1D: the simulator rejected every request of a colocated (0P1D) cluster"
        if all(out[n]["finished"] for n in profiles):
            break
    return out


def compare(mlp_csv: str | None, venv: str, trace: str, run_it: bool = True) -> dict[str, Any]:
    doc: dict[str, Any] = {"config": "one colocated replica, Llama-2-7B, H100, TP 1",
                           "trace": trace}
    doc["vidur_run"] = run_vidur(venv) if run_it else {"ran": False, "why": "not attempted"}
    if mlp_csv is None:
        doc["profile_comparison"] = None
        return doc
    doc["linear_steps"] = linear_step_table(mlp_csv, "h100", "llama2-7b")
    roof, vid = roofline_profile("h100", "llama2-7b"), vidur_profile(mlp_csv)
    doc["vidur_profile"] = vid.to_dict()
    sims = simulate_both(trace, {"roofline": roof, "vidur-derived": vid})
    doc["simulated"] = sims
    doc["sim_difference"] = {
        m: {k: (sims["roofline"][m][k] - sims["vidur-derived"][m][k])
            / sims["vidur-derived"][m][k] for k in ("mean", "p50", "p90", "p99")
            if sims["vidur-derived"][m][k]}
        for m in ("ttft_s", "itl_s", "e2e_s")}
    return doc


def print_report(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    v = doc["vidur_run"]
    con.print(f"vidur {v.get('version') or ''}: ran={v['ran']}; {v.get('why') or ''}")
    if doc.get("linear_steps"):
        t = Table(title="linear operators per step, H100 Llama-2-7B TP1: vidur's profile vs "
                        "our roofline (ms)")
        for c in ("tokens", "vidur", "roofline", "roofline / vidur"):
            t.add_column(c, justify="right")
        for r in doc["linear_steps"]:
            t.add_row(str(r["tokens"]), f"{r['vidur_s'] * 1e3:.2f}",
                      f"{r['roofline_s'] * 1e3:.2f}", f"{r['roofline_over_vidur']:.2f}")
        con.print(t)
        t = Table(title=f"pdserve sim, {doc['simulated']['cluster']}, {doc['trace']}: "
                        "roofline vs vidur-derived profile (ms)")
        for c in ("metric", "mean roof", "mean vidur", "p90 roof", "p90 vidur", "mean diff"):
            t.add_column(c, justify="right")
        s = doc["simulated"]
        for m in ("ttft_s", "itl_s", "e2e_s"):
            a, b = s["roofline"][m], s["vidur-derived"][m]
            t.add_row(m, f"{a['mean'] * 1e3:.1f}", f"{b['mean'] * 1e3:.1f}",
                      f"{a['p90'] * 1e3:.1f}", f"{b['p90'] * 1e3:.1f}",
                      f"{100 * doc['sim_difference'][m].get('mean', 0):+.0f}%")
        con.print(t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.sim.vidur_compare")
    p.add_argument("--vidur-venv", default=DEFAULT_VENV)
    p.add_argument("--mlp-csv", default=None,
                   help="vidur's data/profiling/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv")
    p.add_argument("--trace", default=DEFAULT_TRACE)
    p.add_argument("--skip-vidur", action="store_true", help="do not try to run vidur")
    p.add_argument("--out", default="vidur_compare.json")
    a = p.parse_args(argv)
    doc = compare(a.mlp_csv, a.vidur_venv, a.trace, run_it=not a.skip_vidur)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    print_report(doc)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
