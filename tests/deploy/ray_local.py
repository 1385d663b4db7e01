"""A real multi-node Ray cluster on this machine for tests: a head and a second node, each with
a custom resource of its own (`head_node`, `worker_node`) so placement can be checked.

Owns starting it (`ray start`, a temporary --temp-dir, every port Ray would otherwise take at a
fixed default picked free, a small object store) and stopping only its own processes: every
process it starts carries a marker variable in its environment (inherited by Ray's daemons, its
workers and what they start), and teardown signals exactly the processes that carry it. `ray
stop` would stop every Ray on the machine, other people's included. Its processes inherit no
internal-TLS setting from the test session's environment. Must not know pdserve otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid

from pdserve.launcher.cluster_spec import free_ports

MARKER = "PDSERVE_TEST_RAY"


class LocalRay:
    def __init__(self, repo_root: str, num_cpus: int = 2) -> None:
        self.token = uuid.uuid4().hex[:12]
        self.temp_dir = tempfile.mkdtemp(prefix="pdray-")  # short: Ray's socket paths live here
        self.pdserve_dir = os.path.join(self.temp_dir, "pdserve")  # for --ray-dir
        self.num_cpus = num_cpus
        self.env = dict(os.environ)
        self.env[MARKER] = self.token
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root,
                                                               self.env.get("PYTHONPATH")]))
        # Ray's memory monitor kills workers when the whole (shared) machine runs low.
        self.env["RAY_memory_monitor_refresh_ms"] = "0"
        self.env.pop("RAY_ADDRESS", None)
        # No TLS setting to inherit (a test session's own folder): whatever Ray runs gets its
        # credentials from what it is handed, as on a real cluster.
        for name in ("PDSERVE_TLS_DIR", "PDSERVE_INSECURE_INTERNAL"):
            self.env.pop(name, None)
        self.port = 0
        self.log = os.path.join(self.temp_dir, "ray-start.log")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _ray_start(self, *args: str) -> None:
        ports = free_ports(7)
        common = ["--num-cpus", str(self.num_cpus), "--object-store-memory", "200000000",
                  "--disable-usage-stats", "--temp-dir", self.temp_dir,
                  "--node-ip-address", "127.0.0.1",
                  # 0: workers take ports the kernel hands out, not Ray's default 10002-19999,
                  # where other tests on this machine pick theirs.
                  "--min-worker-port", "0", "--max-worker-port", "0",
                  "--node-manager-port", str(ports[0]), "--object-manager-port", str(ports[1]),
                  "--metrics-export-port", str(ports[2]),
                  "--dashboard-agent-listen-port", str(ports[3]),
                  "--dashboard-agent-grpc-port", str(ports[4]),
                  "--runtime-env-agent-port", str(ports[5])]
        with open(self.log, "ab") as log:
            r = subprocess.run(["ray", "start", *args, *common], env=self.env, stdout=log,
                               stderr=subprocess.STDOUT, timeout=180)
        if r.returncode != 0:
            with open(self.log, errors="replace") as f:
                raise RuntimeError(f"ray start {' '.join(args)} failed:\n{f.read()[-3000:]}")

    def start(self) -> "LocalRay":
        self.port, dashboard, client = free_ports(3)
        try:
            self._ray_start("--head", "--port", str(self.port), "--resources",
                            '{"head_node": 1}', "--include-dashboard", "false",
                            "--dashboard-port", str(dashboard),
                            "--ray-client-server-port", str(client))
            self._ray_start("--address", self.address, "--resources", '{"worker_node": 1}')
        except BaseException:
            self.stop()
            raise
        return self

    def pids(self) -> list[int]:
        """Processes carrying this cluster's marker (Ray's and everything they started)."""
        needle = f"{MARKER}={self.token}".encode()
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        out.append(int(entry))
        return out

    def stop(self, timeout_s: float = 15.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + timeout_s
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
