"""`pdserve serve` as a user runs it: starts every part, serves, and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from tests.e2e.test_cluster import generate
from tests.helpers import free_port


def test_serve_then_sigterm_leaves_no_child_behind(tiny_llama_dir, tmp_path):
    port = free_port()
    args = [sys.executable, "-m", "pdserve.cli", "serve", "--model", tiny_llama_dir,
            "--port", str(port), "--store-port", str(free_port()), "--http-port", "0",
            "--worker-base-port", str(free_port()), "--num-blocks", "64",
            "--controller-port", str(free_port()),
            "--log-dir", str(tmp_path)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # blocks until the cluster is healthy (or serve fails)
        assert line.startswith("pdserve ready on"), proc.stderr.read()
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) == 6  # store master and node, prefill and decode workers, router,
        # and the controller
        ids, text, *_ = generate(f"127.0.0.1:{port}", prompt="Hello", max_tokens=8, ignore_eos=True)
        assert len(ids) == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"left behind: {[p.pid for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_children_die_with_a_killed_serve(tiny_llama_dir, tmp_path):
    """Even kill -9 of `pdserve serve` leaves nothing: children carry a parent-death signal."""
    port = free_port()
    args = [sys.executable, "-m", "pdserve.cli", "serve", "--model", tiny_llama_dir,
            "--port", str(port), "--store-port", str(free_port()), "--http-port", "0",
            "--worker-base-port", str(free_port()), "--num-blocks", "64",
            "--controller-port", str(free_port()),
            "--log-dir", str(tmp_path)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("pdserve ready on"), proc.stderr.read()
        children = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        gone, alive = psutil.wait_procs(children, timeout=20)
        assert not alive, f"left behind: {[p.pid for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
