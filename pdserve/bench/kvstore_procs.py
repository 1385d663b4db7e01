"""The processes behind `pdserve bench kvstore`: a pdserve store (master + node), redis-server.

Owns starting them on free ports (loopback, or a given address), waiting until they serve, and
stopping them (SIGTERM, then kill) however the benchmark ends. A store's children get the
internal-TLS setting they are told (`security.cli.forward`: `--tls-dir DIR` or
`--insecure-internal`), and the command lines they really run with are read back from the
system for the document. Children log to temporary files, never to pipes a full buffer could
block, and their stderr tail goes into the error when one fails to start. Must not time
anything or interpret results.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import IO

from pdserve import rpc
from pdserve.kvstore.master.config import MasterConfig
from pdserve.kvstore.node.config import NodeConfig
from pdserve.launcher.commands import command
from pdserve.security import cli as security_cli
from pdserve.security import tls

START_TIMEOUT_S = 60.0


class ProcessStartError(RuntimeError):
    """A child process did not come up; the message has its exit code and stderr tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picked it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def repo_env() -> dict[str, str]:
    """This environment with the checkout that holds `pdserve` first on PYTHONPATH, so children
    import the same code as this process even when it is not installed."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def _tail(f: IO[bytes], limit: int = 2000) -> str:
    f.flush()
    f.seek(0)
    return f.read().decode(errors="replace")[-limit:]


def stop_process(p: subprocess.Popen | None, timeout_s: float = 10.0) -> None:
    if p is None or p.poll() is not None:
        return
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


class Child:
    """One child process with its stderr captured in a temporary file."""

    def __init__(self, name: str, args: list[str], stdout: int | IO[bytes] | None = None,
                 env: dict[str, str] | None = None):
        self.name = name
        self.stderr = tempfile.TemporaryFile()
        self._stdout_file = None
        if stdout is None:
            self._stdout_file = tempfile.TemporaryFile()
            stdout = self._stdout_file
        try:
            self.proc = subprocess.Popen(args, stdout=stdout, stderr=self.stderr,
                                         env=env or repo_env())
        except OSError as e:
            raise ProcessStartError(f"{name}: cannot start {args[0]}: {e}") from None

    def failed(self, why: str) -> ProcessStartError:
        code = self.proc.poll()
        stop_process(self.proc)
        state = f"exit code {code}" if code is not None else "still running, now stopped"
        return ProcessStartError(f"{self.name} {why} ({state}); stderr: {_tail(self.stderr)}")

    def stop(self) -> None:
        stop_process(self.proc)
        self.stderr.close()
        if self._stdout_file is not None:
            self._stdout_file.close()


def cmdline(pid: int) -> list[str]:
    """The command line process `pid` runs with, as the system reports it ([] if gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        import psutil

        try:
            return psutil.Process(pid).cmdline()
        except psutil.Error:
            return []


class PdserveStore:
    """A store master (file journal in a temporary directory) and one storage node.

    `lease_s` is the master's read lease: short, so that objects removed between rounds give
    their bytes back quickly (a removed object's bytes wait for its lease to end). `security`:
    the internal TLS both run with and this process calls them with (default: this process's
    setting); UCX (`ucx`) only without TLS, as the node refuses it otherwise. `host`: the
    address the master listens on; `node_prefix` runs the node under a command (`ip netns exec
    NS`) and `data_host` is the address its data server binds there.
    """

    def __init__(self, node_dram_bytes: int, host_id: str | None = None, lease_s: float = 0.2,
                 ucx: bool = False, security: tls.Security | None = None,
                 host: str = "127.0.0.1", node_prefix: tuple[str, ...] = (),
                 data_host: str | None = None, name: str = "store"):
        self.node_dram_bytes = node_dram_bytes
        self.security = security if security is not None else tls.current()
        if ucx and not self.security.insecure:
            raise ValueError("a node serves UCX only with internal TLS off (--insecure-internal)")
        self.ucx = ucx  # the node also serves its segment over UCX
        self.host_id = host_id or socket.gethostname()
        self.lease_s = lease_s
        self.host, self.node_prefix, self.data_host = host, tuple(node_prefix), data_host
        self.name = name
        # Unique: a node removes segment files of its own id left by an earlier incarnation,
        # so two stores (or two runs) on one machine must never share one.
        self.node_id = f"bench-{uuid.uuid4().hex[:12]}"
        self.master_address = ""
        self.node_info: dict = {}
        self._journal: tempfile.TemporaryDirectory | None = None
        self._children: list[Child] = []

    def start(self) -> PdserveStore:
        self._journal = tempfile.TemporaryDirectory(prefix="pdserve-bench-journal-")
        self.master_address = f"{self.host}:{free_port()}"
        flags = security_cli.forward(self.security)
        master = Child(f"{self.name} master", [sys.executable, "-m", *command(
            MasterConfig(address=self.master_address, journal_dir=self._journal.name,
                         lease_s=self.lease_s), flags)])
        self._children.append(master)
        try:
            rpc.wait_healthy(self.master_address, timeout_s=START_TIMEOUT_S,
                             peer="master", security_=self.security)
        except Exception as e:
            raise master.failed(f"not healthy on {self.master_address}: {e}") from None
        node_cfg = NodeConfig(node_id=self.node_id, host_id=self.host_id,
                              dram_bytes=self.node_dram_bytes, masters=(self.master_address,),
                              ucx_port=0 if self.ucx else None)
        if self.data_host:
            node_cfg = dataclasses.replace(node_cfg, data_address=f"{self.data_host}:0")
        node = Child(f"{self.name} node", [
            *self.node_prefix, sys.executable, "-m", *command(node_cfg, flags)],
            stdout=subprocess.PIPE)
        self._children.append(node)
        line = node.proc.stdout.readline() if node.proc.stdout else b""
        if not line:
            raise node.failed("printed no ready line")
        self.node_info = json.loads(line)
        return self

    def processes(self) -> list[dict]:
        """Each child's name, pid and the command line the system says it runs with (the node's
        own, from its ready line, under a `node_prefix`)."""
        out = []
        for child in self._children:
            pid = child.proc.pid
            if child is self._children[-1] and self.node_info.get("pid"):
                pid = self.node_info["pid"]
            out.append({"name": child.name, "pid": pid, "cmdline": cmdline(pid)})
        return out

    def wait_registered(self, client, timeout_s: float = START_TIMEOUT_S) -> None:
        """Blocks until the master counts the node alive (it registers in the background)."""
        deadline = time.monotonic() + timeout_s
        while client.stats().nodes_alive < 1:
            if time.monotonic() > deadline:
                raise self._children[-1].failed(f"did not register within {timeout_s}s")
            time.sleep(0.05)

    def stop(self) -> None:
        for child in reversed(self._children):
            if child.proc.stdout:
                child.proc.stdout.close()
            child.stop()
        self._children = []
        if self._journal is not None:
            self._journal.cleanup()
            self._journal = None

    def __enter__(self) -> PdserveStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


class RedisServer:
    """A private redis-server: no persistence, bulk strings up to 1 GiB (a 256 MiB value fits)."""

    def __init__(self, max_bulk: str = "1gb"):
        self.max_bulk = max_bulk
        self.port = 0
        self._child: Child | None = None

    def start(self) -> RedisServer:
        path = redis_server_path()
        if path is None:
            raise ProcessStartError("redis-server not found on PATH (apt-get install redis-server)")
        import redis

        self.port = free_port()
        self._child = Child("redis-server", [
            path, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--proto-max-bulk-len", self.max_bulk,
            "--client-query-buffer-limit", self.max_bulk, "--protected-mode", "no"])
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with redis.Redis(port=self.port, socket_connect_timeout=1) as r:
                    r.ping()
                return self
            except redis.ConnectionError:
                if self._child.proc.poll() is not None or time.monotonic() > deadline:
                    raise self._child.failed(f"did not answer PING on port {self.port}") from None
                time.sleep(0.05)

    def client(self):
        import redis

        # Generous timeouts: a 256 MiB GET through the pure-Python parser takes about a second.
        return redis.Redis(port=self.port, socket_timeout=120)

    def stop(self) -> None:
        if self._child is not None:
            self._child.stop()
            self._child = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
