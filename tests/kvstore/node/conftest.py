"""Fixtures of the storage-node tests: a private directory under /dev/shm, node processes.

Segment files are made in a fresh directory under /dev/shm (real tmpfs, as in production) that
is removed afterwards, so a failed test never leaks shared memory.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from tests.helpers import REPO_ROOT, wait_until  # noqa: F401 - re-exported to the node tests

MiB = 1 << 20


@pytest.fixture
def shm_dir():
    path = tempfile.mkdtemp(prefix="pdserve-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def node_args(node_id: str, data_address: str, dram_bytes: int, shm_dir: str,
              *extra: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.kvstore.node", "--node-id", node_id,
            "--host-id", "test-host", "--data-address", data_address,
            "--dram-bytes", str(dram_bytes), "--shm-dir", shm_dir, *extra]


def start_node(args: list[str], timeout_s: float = 20.0) -> tuple[subprocess.Popen, dict]:
    """Starts a node process and waits for its JSON ready line: (process, ready dict).

    RuntimeError with the exit code and stderr if it exits or stays silent past `timeout_s`.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    stderr = tempfile.TemporaryFile()
    p = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr)
    p.test_stderr = stderr
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout_s)
    line = p.stdout.readline() if ready else b""
    if line:
        return p, json.loads(line)
    p.kill()
    p.wait()
    err = node_stderr(p)
    stderr.close()
    p.stdout.close()
    raise RuntimeError(f"node exited with {p.returncode} before ready: {err}")


def node_stderr(p: subprocess.Popen) -> str:
    if p.test_stderr.closed:
        return p.test_stderr_text
    p.test_stderr.seek(0)
    return p.test_stderr.read().decode(errors="replace")


def stop_node(p: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int:
    """Sends `sig`, waits, returns the exit code (killed and TimeoutError if it hangs)."""
    try:
        if p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                raise TimeoutError(f"node still running {timeout_s}s after {sig!r}") from None
        return p.returncode
    finally:
        p.test_stderr_text = node_stderr(p)
        p.test_stderr.close()
        p.stdout.close()

