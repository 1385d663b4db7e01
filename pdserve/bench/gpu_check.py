"""`python -m pdserve.bench.gpu_check`: the device check, one JSON and one log for a GPU host.

Owns running the steps of `gpu_check_steps` in order, each in a process of its own under a
time limit (a hung kernel or a crash fails that step, recorded with its output's tail, and
the next step runs), within one overall budget (10 minutes by default); writing
`gpu_check.json` and `gpu_check.log` into `--out` (default `$OUT`, else `./gpu_check_out`);
and printing a table. On a host where torch sees no CUDA, `--device cuda` stops before any
step with a clear message and a JSON saying why (exit 2). `--device cpu --quick` runs every
step on the CPU with a tiny model: how the check itself is tested. `--missing-deps` lists the
requirements of pyproject.toml (torch and triton aside) this Python lacks, for the install
script. Must not install anything itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

# Seconds each step may take at most (the overall budget cuts them further).
STEP_LIMITS_S = {"env": 60, "model": 120, "parity": 120, "paged_attn": 60, "codec": 60,
                 "decode": 240, "serve": 180}
NEVER_INSTALLED = ("torch", "triton")  # the host's own builds are kept


def missing_requirements(pyproject: str) -> list[str]:
    """pyproject's runtime requirements that this interpreter does not satisfy (torch and
    triton aside: a GPU host keeps its own)."""
    import tomllib
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    with open(pyproject, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    out = []
    for text in deps:
        req = Requirement(text)
        if req.name in NEVER_INSTALLED:
            continue
        try:
            have = version(req.name)
        except PackageNotFoundError:
            out.append(text)
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            out.append(text)
    return out


# ---- one step, in a process of its own ---------------------------------------------------------
def run_step(name: str, ctx: dict[str, Any], limit_s: float, log) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        result_path = f.name
    env = dict(os.environ)
    if ctx["device"] == "cpu":
        env["TRITON_INTERPRET"] = "1"  # Triton kernels run in the interpreter on the CPU
    cmd = [sys.executable, "-m", "pdserve.bench.gpu_check", "--run-step", name,
           "--context", json.dumps(ctx), "--result", result_path]
    t0 = time.monotonic()
    log.write(f"==== step {name} (limit {limit_s:.0f}s)\n")
    log.flush()
    try:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                              timeout=max(1.0, limit_s))
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        rc = None
    wall = time.monotonic() - t0
    try:
        with open(result_path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        result = {}
    finally:
        if os.path.exists(result_path):
            os.unlink(result_path)
    if rc is None:
        result = {"status": "failed", "error": f"timed out after {limit_s:.0f}s"}
    elif rc != 0 and "status" not in result:
        result = {"status": "failed", "error": result.get("error") or f"exit code {rc}"}
    log.write(f"==== step {name}: {result.get('status')} in {wall:.1f}s\n")
    log.flush()
    return {"name": name, "wall_s": round(wall, 2), **result}


def _step_main(name: str, ctx: dict[str, Any], result_path: str) -> int:
    import traceback

    from pdserve.bench.gpu_check_steps import STEPS

    try:
        result = STEPS[name](**ctx)
        code = 0
    except Exception as e:  # recorded, not fatal: the driver runs the next step
        traceback.print_exc()
        result, code = {"status": "failed", "error": f"{type(e).__name__}: {e}"}, 1
    with open(result_path, "w") as f:
        json.dump(result, f, default=str)
    return code


# ---- the whole check ---------------------------------------------------------------------------
def cuda_problem(device: str) -> str | None:
    """Why `device` cannot run here, before any step (None: it can)."""
    from pdserve.engine.device import DeviceError, resolve_device

    try:
        resolve_device(device)
    except DeviceError as e:
        return str(e)
    return None


def run_check(device: str, *, quick: bool, out_dir: str, model: str | None, shape: str,
              budget_s: float, steps: list[str]) -> dict[str, Any]:
    os.makedirs(out_dir, exist_ok=True)
    doc: dict[str, Any] = {"check": "gpu", "device": device, "quick": quick,
                           "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "budget_s": budget_s, "steps": [], "stopped": None}
    problem = cuda_problem(device)
    if problem is not None:
        doc.update(ok=False, stopped=problem)
        return doc
    from pdserve.engine.device import resolve_device

    device = doc["device"] = resolve_device(device)
    work = tempfile.mkdtemp(prefix="pdserve-gpu-check-")
    ctx: dict[str, Any] = {"device": device, "quick": quick, "work_dir": work, "model": model,
                           "shape": shape, "model_path": model}
    t0 = time.monotonic()
    with open(os.path.join(out_dir, "gpu_check.log"), "w") as log:
        for name in steps:
            left = budget_s - (time.monotonic() - t0)
            if left < 5:
                doc["steps"].append({"name": name, "status": "failed",
                                     "error": "the check's time budget was spent"})
                continue
            if name != "model" and ctx["model_path"] is None and name in (
                    "parity", "decode", "serve"):
                doc["steps"].append({"name": name, "status": "failed",
                                     "error": "no model (the model step failed)"})
                continue
            _progress(f"{name} ...")
            limit = min(STEP_LIMITS_S[name], left)
            if name == "serve":
                ctx["timeout_s"] = max(10.0, limit - 30)
            step = run_step(name, ctx, limit, log)
            ctx.pop("timeout_s", None)
            if name == "model" and step.get("status") == "ok":
                ctx["model_path"] = step["path"]
            doc["steps"].append(step)
            _progress(f"{name}: {step.get('status')} ({step['wall_s']:.0f}s)")
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    doc["ok"] = all(s.get("status") in ("ok", "missing") for s in doc["steps"])
    return doc


def _progress(text: str) -> None:
    print(f"gpu_check: {text}", file=sys.stderr, flush=True)


def print_table(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if doc.get("stopped"):
        console.print(f"[bold red]gpu_check stopped[/]: {doc['stopped']}")
        return
    t = Table(title=f"gpu check on {doc['device']}{' (quick)' if doc['quick'] else ''}")
    for col in ("step", "status", "seconds", "figures"):
        t.add_column(col)
    for s in doc["steps"]:
        t.add_row(s["name"], s.get("status", "?"), f"{s.get('wall_s', 0):.0f}", _figures(s))
    console.print(t)
    for s in doc["steps"]:
        if s["name"] == "decode" and s.get("rows"):
            d = Table(title=f"decode on {doc['device']}, {s.get('dtype')}")
            for col in ("batch", "engine tok/s", "HF tok/s", "ratio", "of copy bound",
                        "of stated bound"):
                d.add_column(col, justify="right")
            for r in s["rows"]:
                stated = r.get("engine_fraction_of_stated_bound")
                d.add_row(str(r["batch_size"]), f"{r['engine_tokens_per_s']:.0f}",
                          f"{r['transformers_tokens_per_s']:.0f}", f"{r['ratio']:.2f}x",
                          f"{r['engine_fraction_of_bound']:.0%}",
                          "-" if stated is None else f"{stated:.0%}")
            console.print(d)
            a = s.get("aims", {})
            for what, key in (("engine/transformers at batch 32", "ratio_b32"),
                              ("share of the HBM bound at batch 1", "bound_fraction_b1")):
                met = a.get(f"{key}_met")
                console.print(f"aim: {what} >= {a.get(f'{key}_aim')}: "
                              f"{'not measured' if met is None else 'met' if met else 'not met'}")


def _figures(s: dict[str, Any]) -> str:
    if s.get("error"):
        return str(s["error"])[:90]
    hidden = ("name", "status", "wall_s", "rows", "document", "output", "nvidia_smi", "aims")
    keep = {k: v for k, v in s.items() if k not in hidden}
    return json.dumps(keep, default=str)[:200]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.gpu_check",
                                description=__doc__.split("\n", 1)[0])
    p.add_argument("--device", default="cuda", help="auto, cpu, cuda or cuda:N (default cuda)")
    p.add_argument("--quick", action="store_true",
                   help="small sizes and a tiny model: the CPU test of the check itself")
    p.add_argument("--out", default=None, help="folder for gpu_check.json and gpu_check.log "
                                                "(default: $OUT, else ./gpu_check_out)")
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: a checkpoint "
                                                  "of --shape with random weights)")
    p.add_argument("--shape", default=None, choices=["tiny", "smollm2-135m", "llama-1b"],
                   help="the random checkpoint's shape (default: tiny with --quick, else "
                        "smollm2-135m)")
    p.add_argument("--budget-s", type=float, default=600.0, help="the whole check's limit")
    p.add_argument("--steps", default=",".join(STEP_LIMITS_S),
                   help=f"comma-separated subset of {','.join(STEP_LIMITS_S)}")
    p.add_argument("--missing-deps", metavar="PYPROJECT",
                   help="print the requirements this Python lacks, one a line, and exit")
    p.add_argument("--run-step", help=argparse.SUPPRESS)
    p.add_argument("--context", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.missing_deps:
        print("\n".join(missing_requirements(a.missing_deps)))
        return 0
    if a.run_step:
        return _step_main(a.run_step, json.loads(a.context), a.result)
    steps = [s.strip() for s in a.steps.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEP_LIMITS_S]
    if bad:
        p.error(f"--steps: unknown {', '.join(bad)}; choose from {', '.join(STEP_LIMITS_S)}")
    if a.model is None and "model" not in steps:
        steps.insert(0, "model")
    out_dir = a.out or os.environ.get("OUT") or "gpu_check_out"
    doc = run_check(a.device, quick=a.quick, out_dir=out_dir, model=a.model,
                    shape=a.shape or ("tiny" if a.quick else "smollm2-135m"),
                    budget_s=a.budget_s, steps=steps)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(doc, f, indent=2, default=str)
        f.write("\n")
    print_table(doc)
    if doc.get("stopped"):
        print(f"gpu_check: stopped: {doc['stopped']} (wrote {out_dir}/gpu_check.json)",
              file=sys.stderr)
        return 2
    print(f"gpu_check: {'all steps ok' if doc['ok'] else 'some steps failed'}; wrote "
          f"{out_dir}/gpu_check.json and gpu_check.log", file=sys.stderr)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
