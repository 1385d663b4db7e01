"""`--device` on the commands: `pdserve serve` lists the host's GPUs without torch (a stand-in
`nvidia-smi` on PATH plays a GPU host here), gives each worker its own, refuses more workers than
GPUs unless told to share, and refuses `--device cuda` on a host without GPUs before anything
starts, in one line naming the flag; a worker and `bench decode` asked for CUDA where torch
sees none exit 2 saying so."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.launcher.cluster_spec import ClusterSpec


def _fake_smi(tmp_path, n: int) -> dict[str, str]:
    """An environment whose PATH starts with an `nvidia-smi` listing `n` H200s."""
    lines = "\\n".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i:08x})" for i in range(n))
    exe = tmp_path / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\nprintf '{lines}\\n'\n")
    exe.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = f"{tmp_path}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_each_worker_gets_its_own_visible_gpu(tmp_path, monkeypatch):
    for k, v in _fake_smi(tmp_path, 4).items():
        monkeypatch.setenv(k, v)
    spec = ClusterSpec("m.gguf", prefill_workers=1, decode_workers=2).resolved()
    assert spec.worker_devices == ("cuda:0", "cuda:1", "cuda:2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")  # indexes count within the visible set
    spec = ClusterSpec("m.gguf", decode_workers=1, device="cuda").resolved()
    assert spec.worker_devices == ("cuda:0", "cuda:1")
    with pytest.raises(ValueError, match="--share-gpus"):
        ClusterSpec("m.gguf", decode_workers=2).resolved()
    spec = ClusterSpec("m.gguf", decode_workers=2, share_gpus=True).resolved()
    assert spec.worker_devices == ("cuda:0", "cuda:1", "cuda:0")
    assert ClusterSpec("m.gguf", device="cpu").resolved().worker_devices == ("cpu", "cpu")


def test_a_restart_keeps_the_planned_devices(tmp_path, monkeypatch):
    for k, v in _fake_smi(tmp_path, 2).items():
        monkeypatch.setenv(k, v)
    spec = ClusterSpec("m.gguf").resolved()
    monkeypatch.setenv("PATH", "/nonexistent")  # the GPUs cannot be listed any more
    assert spec.resolved().worker_devices == spec.worker_devices == ("cuda:0", "cuda:1")


def _serve(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    code = ("import sys, pdserve.cli as c\nrc = c.main(['serve', *sys.argv[1:]])\n"
            "assert 'torch' not in sys.modules\nsys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_serve_refuses_cuda_without_gpus_before_starting(tmp_path):
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}/usr/bin:/bin"}  # no nvidia-smi
    log_dir = tmp_path / "logs"
    out = _serve(["--device", "cuda", "--log-dir", str(log_dir)], env)
    assert out.returncode == 2, out.stderr
    assert "--device cuda: no GPU is visible" in out.stderr
    assert not log_dir.exists()  # nothing was started


def test_serve_refuses_more_workers_than_gpus_unless_shared(tmp_path):
    out = _serve(["--device", "cuda", "--decode-workers", "2"], _fake_smi(tmp_path, 2))
    assert out.returncode == 2, out.stderr
    assert "3 workers need 3 GPUs, but 2 visible" in out.stderr and "--share-gpus" in out.stderr


def test_serve_refuses_a_bad_device_value():
    out = _serve(["--device", "tpu"], dict(os.environ))
    assert out.returncode == 2
    assert "--device must be auto, cpu, cuda or cuda:N, got 'tpu'" in out.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this host has CUDA")
def test_a_worker_asked_for_cuda_without_it_exits_2_naming_the_flag():
    out = subprocess.run([sys.executable, "-m", "pdserve.worker", "--model", "m.gguf",
                          "--device", "cuda:1", "--store-kind", "simple",
                          "--store-address", "127.0.0.1:1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "pdserve.worker: --device cuda:1: torch sees no CUDA device" in out.stderr
    bad = subprocess.run([sys.executable, "-m", "pdserve.worker", "--model", "m.gguf",
                          "--device", "gpu0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--device must be auto, cpu, cuda or cuda:N" in bad.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this host has CUDA")
def test_bench_decode_on_cuda_without_it_says_so_before_loading_a_model():
    code = ("import sys, pdserve.cli as c\n"
            "sys.exit(c.main(['bench', 'decode', '--device', 'cuda', '--model', 'none.gguf']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert "pdserve bench decode: --device cuda: torch sees no CUDA device" in out.stderr
