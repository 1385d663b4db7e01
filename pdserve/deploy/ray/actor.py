"""One pdserve process under a Ray actor: started, watched, restarted, stopped on its node.

Owns the process's life on the Ray node the actor was placed on: free ports picked there
(`free_ports`), the process started as `python -X pdserve_cluster=<id> -m pdserve.cli <kind>
...` in a session of its own (its process group is what `stop` kills: `ray.kill` of the actor
alone would leave it running), its log file, a pid file the sweep reads after an actor died
(`sweep_node`), readiness (gRPC health; a storage node's ready line), and supervision: a
process that dies while the actor lives is restarted under `supervisor.RestartPolicy` (backoff,
give-up on a crash loop), its exits and restarts reported by `status()`.

One thread spawns every incarnation and lives as long as the actor: the process's parent-death
signal (`pdserve.lifecycle`) fires when the spawning *thread* exits, so the process also ends
when the actor's process does (killed, or its node lost), without waiting for a sweep.

Must not decide placement or wiring (`plan.py`, `backend.py`) nor when to restart (the pure
`supervisor.decide`). Importable without Ray: `backend.py` wraps the class with `ray.remote`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future

from pdserve.controller.cluster_spec import free_ports
from pdserve.controller.supervise import tail
from pdserve.controller.supervisor import GIVE_UP, RESTART, RestartPolicy, Run, decide
from pdserve.deploy.ray.plan import cluster_marker, store_node_id
from pdserve.lifecycle import child_env


def pid_dir(base_dir: str, cluster_id: str, ray_node_id: str) -> str:
    return os.path.join(base_dir, cluster_id, "pids", ray_node_id)


class ProcessHost:
    def __init__(self, cluster_id: str, member: str, kind: str, base_dir: str,
                 policy: RestartPolicy | None, poll_s: float = 0.2) -> None:
        import ray

        ctx = ray.get_runtime_context()
        self.cluster_id, self.member, self.kind = cluster_id, member, kind
        self.node_id = ctx.get_node_id()
        self.ip = ray.util.get_node_ip_address()
        self.gpu_ids = [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]
        self.policy, self.poll_s = policy, poll_s
        self.pid_file = os.path.join(pid_dir(base_dir, cluster_id, self.node_id), f"{member}.pid")
        self.argv: list[str] = []
        self.address = ""
        self.log_path = ""
        self.proc: subprocess.Popen | None = None
        self.state = "new"  # new, starting, running, restarting, exited, gave up, stopped
        self.exit_code: int | None = None
        self.restarts = 0
        self.reason = ""
        self._runs: deque[Run] = deque(maxlen=(policy or RestartPolicy()).history_len())
        self._started_s = 0.0
        self._lock = threading.Lock()
        self._jobs: queue.Queue[Future] = queue.Queue(maxsize=4)
        self._thread = threading.Thread(target=self._run, name="pdserve-process", daemon=True)
        self._thread.start()

    # Placement facts and ports, asked before the command line can be written.

    def node(self) -> dict:
        return {"node_id": self.node_id, "ip": self.ip, "hostname": socket.gethostname(),
                "actor_pid": os.getpid(), "gpu_ids": self.gpu_ids}

    def free_ports(self, n: int) -> list[int]:
        return free_ports(n)

    # The process.

    def start(self, args: list[str], address: str, run_dir: str) -> dict:
        """Start `pdserve <args>`; `address` is where it answers health checks ("" for a
        storage node, which prints a ready line instead)."""
        with self._lock:
            if self.state != "new":
                raise RuntimeError(f"{self.member} was started already ({self.state})")
            self.state = "starting"
            self.argv = [sys.executable, *cluster_marker(self.cluster_id), "-m", "pdserve.cli",
                         *args]
            self.address = address
            self.log_path = os.path.join(run_dir, "logs", f"{self.member}.log")
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        os.makedirs(os.path.dirname(self.pid_file), exist_ok=True)
        job: Future = Future()
        self._jobs.put(job)
        job.result(timeout=60)
        return self.status()

    def wait_ready(self, timeout_s: float) -> dict:
        """Returns the status once the process serves; raises RuntimeError naming the member
        and the end of its log if it exits first or is not ready within `timeout_s`."""
        from pdserve import rpc

        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                proc, state = self.proc, self.state
            if proc is None or proc.poll() is not None or state in ("gave up", "stopped"):
                code = proc.poll() if proc is not None else None
                raise RuntimeError(f"{self.member} exited with {code} before it was ready; its "
                                   f"log ({self.log_path} on {self.ip}) ends:\n"
                                   f"{tail(self.log_path)}")
            if self.address:
                try:
                    rpc.wait_healthy(self.address, timeout_s=1.0)
                    return self.status()
                except TimeoutError:
                    pass
            elif self._log_has('"event": "ready"'):
                return self.status()
            else:
                time.sleep(0.1)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.member} at {self.address or self.ip} not ready after "
                                   f"{timeout_s:g}s; its log ({self.log_path} on {self.ip}) "
                                   f"ends:\n{tail(self.log_path)}")

    def status(self) -> dict:
        with self._lock:
            proc = self.proc
            out = {"member": self.member, "kind": self.kind, "state": self.state,
                   "pid": proc.pid if proc is not None and self.state == "running" else None,
                   "exit_code": self.exit_code, "restarts": self.restarts,
                   "reason": self.reason, "address": self.address, "node_id": self.node_id,
                   "ip": self.ip, "log": self.log_path, "gpu_ids": self.gpu_ids,
                   "actor_pid": os.getpid()}
        out["health"] = self._health() if out["state"] == "running" else ""
        return out

    def _health(self) -> str:
        """Its gRPC health now (SERVING, NOT_SERVING, or no answer); a storage node, which
        serves no gRPC: whether it printed its ready line."""
        if not self.address:
            return "ready" if self._log_has('"event": "ready"') else "starting"
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from pdserve import rpc

        with rpc.make_channel(self.address) as ch:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=1.0)
                return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
            except grpc.RpcError as e:
                return f"no answer ({e.code().name})"

    def stop(self, timeout_s: float = 10.0) -> dict:
        """SIGTERM to the process group, SIGKILL after `timeout_s`; never restarted after."""
        with self._lock:
            proc, self.state = self.proc, "stopped"
        if proc is not None:
            _kill_group(proc, timeout_s)
            self.exit_code = proc.returncode
        with contextlib.suppress(OSError):
            os.unlink(self.pid_file)
        return self.status()

    # Kind-specific questions, asked on this node (the driver may not reach internal addresses).

    def store_nodes_alive(self) -> int:
        from pdserve import rpc
        from pdserve.proto import kvmaster_pb2 as pb
        from pdserve.proto import kvmaster_pb2_grpc as pb_grpc

        with rpc.make_channel(self.address) as ch:
            return pb_grpc.KVMasterStub(ch).Stats(pb.MasterStatsRequest(), timeout=5).nodes_alive

    def router_members(self) -> list[tuple[str, str]]:
        """(address, state name) of every worker the router knows."""
        from pdserve import rpc
        from pdserve.proto import router_pb2 as rpb
        from pdserve.proto import router_pb2_grpc as rpb_grpc

        with rpc.make_channel(self.address) as ch:
            r = rpb_grpc.RouterControlStub(ch).ListWorkers(rpb.ListWorkersRequest(), timeout=5)
        return [(w.address, rpb.MemberState.Name(w.state)) for w in r.workers]

    # The thread that spawns and supervises.

    def _log_has(self, text: str) -> bool:
        try:
            with open(self.log_path, errors="replace") as f:
                return text in f.read()
        except OSError:
            return False

    def _spawn(self, mode: str, note: str = "") -> None:
        env = child_env(code_env())
        if self.gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpu_ids)
        with open(self.log_path, mode) as log:
            log.write(note.encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)
        self._started_s = time.monotonic()
        self.state = "running"
        with open(self.pid_file, "w") as f:
            f.write(f"{self.proc.pid}\n")

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.poll_s)
            except queue.Empty:
                job = None
            with self._lock:
                if job is not None:
                    try:
                        if self.state == "stopped":  # stopped before it ever ran
                            raise RuntimeError(f"{self.member} was stopped")
                        self._spawn("wb")
                        job.set_result(None)
                    except Exception as e:  # the caller raises it
                        job.set_exception(e)
                try:
                    self._supervise(time.monotonic())
                except Exception as e:  # a restart that cannot spawn: this thread carries on
                    self.state, self.reason = "gave up", f"restart failed: {e}"

    def _supervise(self, now_s: float) -> None:
        proc = self.proc
        if proc is None or self.state in ("stopped", "gave up"):
            return
        if self.state == "running":
            code = proc.poll()
            if code is None:
                return
            self.exit_code = code
            self._runs.append(Run(self._started_s, now_s, code, restart=self.restarts > 0))
            if self.policy is None:
                self.state, self.reason = "exited", "not supervised"
                return
            self.state = "restarting"
        decision = decide(self.policy, list(self._runs), now_s)
        self.reason = decision.reason
        if decision.action == GIVE_UP:
            self.state = "gave up"
            with contextlib.suppress(OSError), open(self.log_path, "a") as log:
                log.write(f"\n[pdserve on ray] gave up on {self.member}: {decision.reason}\n")
        elif decision.action == RESTART:
            self.restarts += 1
            self._spawn("ab", f"\n[pdserve on ray] restarting {self.member} (exit "
                              f"{self.exit_code}), attempt {self.restarts}\n")


def code_env() -> dict[str, str]:
    """This environment, where a child's `python -m pdserve.cli` imports the pdserve this actor
    runs: a source checkout that Ray put on the actor's path (the driver's directory) goes on
    the child's PYTHONPATH; an installed one is found there anyway."""
    import pdserve

    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(pdserve.__file__)))
    if os.path.basename(root) not in ("site-packages", "dist-packages"):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def _kill_group(proc: subprocess.Popen, timeout_s: float) -> None:
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def sweep_node(base_dir: str, cluster_id: str, ray_node_id: str, timeout_s: float = 10.0,
               shm_dir: str = "/dev/shm") -> list[int]:
    """Stop the processes this cluster's actors left on this node (recorded by pid, checked by
    the cluster marker in their command line, so a reused pid is never touched) and its
    storage node's segment files; the pids stopped."""
    directory = pid_dir(base_dir, cluster_id, ray_node_id)
    marker = ("\0".join(cluster_marker(cluster_id)) + "\0").encode()
    found = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        path = os.path.join(directory, name)
        try:
            with open(path) as f:
                pid = int(f.read().strip())
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                mine = marker in f.read()
        except (OSError, ValueError):
            mine = False
        if mine:
            found.append(pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
        with contextlib.suppress(OSError):
            os.unlink(path)
    deadline = time.monotonic() + timeout_s
    for pid in found:
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.path.exists(f"/proc/{pid}"):
                os.killpg(pid, signal.SIGKILL)
    # A storage node killed past its stop could not unlink its segment (names as the node's).
    segment = re.compile(rf"pdserve-{re.escape(store_node_id(cluster_id, ray_node_id))}"
                         rf"\.[0-9a-f]{{8}}\.dram\d+")
    for name in os.listdir(shm_dir) if os.path.isdir(shm_dir) else []:
        if segment.fullmatch(name):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(shm_dir, name))
    return found
