"""Shared test helpers: free loopback ports and service processes started and stopped cleanly.

Owns starting a pdserve service as a child process, waiting until it reports SERVING on the
gRPC health service, and stopping it with SIGTERM. Must not know any particular service.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Sequence
from unittest import mock

from pdserve.rpc import ANY, PUBLIC, wait_healthy

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port that was free a moment ago, picked the launcher's way: below the kernel's
    ephemeral range where it can, so no outgoing connection takes it before a child that first
    loads a model binds it."""
    from pdserve.launcher.cluster_spec import free_ports

    return free_ports(1)[0]


def _read(f) -> str:
    f.flush()
    f.seek(0)
    return f.read().decode(errors="replace")


def process_output(p: subprocess.Popen) -> tuple[str, str]:
    """(stdout, stderr) written so far by a process from start_process (all of it once stopped)."""
    final = getattr(p, "pdserve_final_output", None)
    return final if final is not None else (_read(p.pdserve_stdout), _read(p.pdserve_stderr))


def start_process(
    args: Sequence[str], ready_address: str, timeout_s: float = 30.0, peer: str | None = None,
    security=None,
) -> subprocess.Popen:
    """Starts `args` in the repo root and waits until `ready_address` reports SERVING.

    `peer`: what serves `ready_address` (`rpc.wait_healthy`); default: a router's client port
    (plaintext) for `pdserve.router`, else any cluster server (mutual TLS, as `security`,
    default this process's setting).

    On failure (the child exits, or is not healthy within `timeout_s`) the child is killed and
    RuntimeError is raised with its exit code and stderr.
    """
    # Temporary files, not pipes: a child that logs a lot must never block on a full pipe.
    stdout, stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    p = subprocess.Popen(list(args), cwd=REPO_ROOT, env=env, stdout=stdout, stderr=stderr)
    p.pdserve_stdout, p.pdserve_stderr = stdout, stderr
    if peer is None:
        peer = PUBLIC if "pdserve.router" in args else ANY
    deadline = time.monotonic() + timeout_s
    problem = f"not healthy within {timeout_s}s"
    while time.monotonic() < deadline:
        if p.poll() is not None:
            problem = f"exited with code {p.returncode} before it was healthy"
            break
        try:
            # Short slices so a child that dies is noticed at once, not at the deadline.
            wait_healthy(ready_address, timeout_s=min(0.5, max(0.01, deadline - time.monotonic())),
                         peer=peer, security_=security)
            return p
        except TimeoutError:
            continue
    if p.poll() is None:
        p.kill()
        p.wait()
    p.pdserve_final_output = process_output(p)
    stdout.close()
    stderr.close()
    err = p.pdserve_final_output[1]
    raise RuntimeError(f"{' '.join(args)} on {ready_address}: {problem}; stderr:\n{err}")


def stop_process(p: subprocess.Popen, timeout_s: float = 5.0) -> int:
    """Sends SIGTERM and returns the exit code; kills it and raises TimeoutError if it hangs."""
    try:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                _, err = process_output(p)
                raise TimeoutError(
                    f"pid {p.pid} still running {timeout_s}s after SIGTERM; stderr:\n{err}"
                ) from None
        return p.returncode
    finally:
        if getattr(p, "pdserve_final_output", None) is None:
            p.pdserve_final_output = process_output(p)
            p.pdserve_stdout.close()
            p.pdserve_stderr.close()


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    """Whether `predicate()` came true within `timeout_s` (polled every 10 ms)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def parser_of(main) -> argparse.ArgumentParser:
    """The parser a process's `main` builds, caught at parse_args (nothing else runs)."""
    def capture(self, *args, **kwargs):
        raise _Parsed(self)
    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            main([])
        except _Parsed as e:
            return e.parser
    raise AssertionError(f"{main.__module__}.main never parsed its arguments")
