"""The device check, on a machine without a GPU: everything up to the point where it needs CUDA.

`--device cpu --quick` runs every step (a tiny random checkpoint, engine/transformers parity,
the codec's Triton kernels in the interpreter, a quick decode benchmark, the embedded cluster
serving a request) and writes a JSON whose every step is ok, the paged-attention kernel's
"missing" only while its module is absent. `--device cuda` where torch sees no CUDA stops
before any step, exit 2, with a message and a JSON saying why.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from pdserve.bench.gpu_check import missing_requirements

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check(*args: str, timeout_s: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("OUT", None)
    return subprocess.run([sys.executable, "-m", "pdserve.bench.gpu_check", *args],
                          capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)


@pytest.mark.timeout(420)
def test_quick_cpu_check_runs_every_step(tmp_path):
    out = _check("--device", "cpu", "--quick", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert (tmp_path / "gpu_check.log").stat().st_size > 0
    assert doc["device"] == "cpu" and doc["quick"] is True and doc["ok"] is True
    assert doc["stopped"] is None
    steps = {s["name"]: s for s in doc["steps"]}
    assert list(steps) == ["env", "model", "parity", "paged_attn", "codec", "decode", "serve"]
    has_kernel = importlib.util.find_spec("pdserve.engine.paged_attn_triton") is not None
    for name, s in steps.items():
        want = "missing" if name == "paged_attn" and not has_kernel else "ok"
        assert s["status"] == want, (name, s)
        assert s["wall_s"] >= 0
    assert steps["parity"]["fp32"]["greedy_identical"] == "3/3"
    assert steps["parity"]["fp32"]["logits_max_rel_err"] <= 1e-4
    assert steps["parity"]["bf16"]["logits_rel_l2_err"] <= 3e-2
    assert {steps["codec"][d] for d in ("float32", "bfloat16", "float16")} == {"bit-exact"}
    rows = steps["decode"]["rows"]
    assert [r["batch_size"] for r in rows] == [1, 2]
    assert all(r["engine_tokens_per_s"] > 0 and r["transformers_tokens_per_s"] > 0 for r in rows)
    assert steps["serve"]["worker_devices"] == ["cpu", "cpu"]
    assert "8 completion tokens" in steps["serve"]["usage"]
    assert "gpu check on cpu" in out.stdout  # the table


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_cuda_check_without_cuda_stops_early_and_says_why(tmp_path):
    out = _check("--device", "cuda", "--out", str(tmp_path), timeout_s=120)
    assert out.returncode == 2
    assert "torch sees no CUDA device" in out.stderr + out.stdout
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["ok"] is False and doc["steps"] == []
    assert "--device cuda" in doc["stopped"] and "no CUDA device" in doc["stopped"]
    assert not (tmp_path / "gpu_check.log").exists()  # no step ran


def test_missing_requirements_skip_torch_and_triton(tmp_path):
    py = tmp_path / "pyproject.toml"
    py.write_text('[project]\nname = "x"\ndependencies = ["torch==0.0.1", "triton==0.0.1", '
                  '"numpy>=1", "rich>=9999", "surely-not-a-package-here>=1"]\n')
    assert missing_requirements(str(py)) == ["rich>=9999", "surely-not-a-package-here>=1"]


def test_an_unknown_step_is_refused(tmp_path):
    out = _check("--device", "cpu", "--steps", "env,warp", "--out", str(tmp_path), timeout_s=60)
    assert out.returncode == 2 and "--steps: unknown warp" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
@pytest.mark.timeout(300)
def test_the_script_installs_over_the_hosts_torch_then_stops_without_cuda(tmp_path):
    """scripts/gpu_check.sh into a fresh environment that sees this Python's packages (as a GPU
    host's own torch): pdserve is installed editable, torch is left alone, and the check stops
    at the point where it needs CUDA."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT")}
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--out",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=280,
                         env={**env, "PYTHON": py})
    assert out.returncode == 2, out.stderr[-3000:]
    assert "installing pdserve (editable, no dependencies)" in out.stderr
    assert "torch sees no CUDA device" in out.stderr
    doc = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert doc["ok"] is False and "no CUDA device" in doc["stopped"]
    where = subprocess.run([py, "-c", "import pdserve, torch; print(pdserve.__file__, "
                                      "torch.__version__)"], capture_output=True, text=True,
                           timeout=120, cwd=str(tmp_path), env=env)
    assert where.stdout.split() == [os.path.join(ROOT, "pdserve", "__init__.py"),
                                    torch.__version__], where.stderr
