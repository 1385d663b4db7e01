"""One pdserve process under a Ray actor: started, watched, restarted, stopped on its node.

Owns the process's life on the Ray node the actor was placed on: free ports picked there
(`free_ports`), the process started as `python -X pdserve_cluster=<id> -m pdserve.cli <kind>
...` in a session of its own (its process group is what `stop` kills: `ray.kill` of the actor
alone would leave it running), its log file, a pid file the sweep reads after an actor died
(`sweep_node`), readiness (gRPC health; a storage node's ready line), and supervision: a
process that dies while the actor lives is restarted under `launcher.restart.RestartPolicy` (backoff,
give-up on a crash loop), its exits and restarts reported by `status()`.

Internal TLS: `start` receives the member's bundle (`certs.bundle_names`: ca.crt and its own
kind's certificate and key, nothing else) and writes it to the member's folder on this node
(`plan.member_tls_dir`; 0700, the key 0600), which the process gets as `--tls-dir`; this
actor's own calls (health, the master's Stats, the router's ListWorkers) go out with the same
certificate (`tls.configure` of the actor's process). `renew_tls` rewrites the files in place:
the process re-reads them within a second, no restart. `stop` removes the folder.

One thread spawns every incarnation and lives as long as the actor: the process's parent-death
signal (`pdserve.lifecycle`) fires when the spawning *thread* exits, so the process also ends
when the actor's process does (killed, or its node lost), without waiting for a sweep.

Must not decide placement or wiring (`plan.py`, `backend.py`) nor when to restart (the pure
`launcher.restart.decide`). Importable without Ray: `backend.py` wraps the class with `ray.remote`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future

from pdserve.launcher.cluster_spec import free_ports
from pdserve.launcher.supervision import tail
from pdserve.launcher.restart import GIVE_UP, RESTART, RestartPolicy, Run, decide
from pdserve.deploy.ray.plan import (cluster_marker, member_tls_dir, probe_peer, store_node_id,
                                     tls_root)
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
        self.tls_dir = member_tls_dir(base_dir, cluster_id, member)
        self.tls = ""  # "mutual" or "insecure", once started
        self.cert_not_after = ""  # ISO time its certificate ends
        self.argv: list[str] = []
        self.address = ""
        self.probe = ""  # where it answers health (the router: its control listener)
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

    def start(self, args: list[str], address: str, run_dir: str, probe: str = "",
              tls_files: dict[str, bytes] | None = None) -> dict:
        """Start `pdserve <args>`; `address` is where it serves ("" for a storage node, which
        prints a ready line instead), `probe` where it answers health checks (default: its
        address). `tls_files`: its TLS bundle, written to its folder before it starts; None
        with `--insecure-internal`. (An argument of this call, not of the constructor: Ray
        keeps a detached actor's constructor arguments for its whole life.)"""
        with self._lock:
            if self.state != "new":
                raise RuntimeError(f"{self.member} was started already ({self.state})")
            self._use_tls(tls_files)
            self.state = "starting"
            self.argv = [sys.executable, *cluster_marker(self.cluster_id), "-m", "pdserve.cli",
                         *args]
            self.address, self.probe = address, probe or address
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
            if self.probe:
                try:
                    rpc.wait_healthy(self.probe, timeout_s=1.0, peer=probe_peer(self.member))
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
                   "actor_pid": os.getpid(), "tls": self.tls,
                   "tls_dir": self.tls_dir if self.tls == "mutual" else "",
                   "cert_not_after": self.cert_not_after}
        out["health"] = self._health() if out["state"] == "running" else ""
        return out

    def _health(self) -> str:
        """Its gRPC health now (SERVING, NOT_SERVING, or no answer); a storage node, which
        serves no gRPC: whether it printed its ready line."""
        if not self.probe:
            return "ready" if self._log_has('"event": "ready"') else "starting"
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from pdserve import rpc

        with rpc.make_channel(self.probe, probe_peer(self.member)) as ch:
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
        shutil.rmtree(self.tls_dir, ignore_errors=True)  # its key stays nowhere
        return self.status()

    # Internal TLS.

    def _use_tls(self, files: dict[str, bytes] | None) -> None:
        """Write the bundle to this member's folder and make it this actor's own setting."""
        from pdserve.security import tls

        if files is None:
            tls.configure(tls.Insecure())
            self.tls = "insecure"
            return
        self._write_tls(files)
        tls.configure(tls.MutualTls(tls.TlsFolder(self.tls_dir), self.kind))
        self.tls = "mutual"

    def _write_tls(self, files: dict[str, bytes]) -> None:
        from pdserve.deploy.ray.certs import bundle_names
        from pdserve.security import pki

        ca, cert, key = bundle_names(self.kind)
        if set(files) != {ca, cert, key}:  # another kind's key never lands on this node
            raise ValueError(f"{self.member}: a {self.kind}'s TLS bundle is {ca}, {cert} and "
                             f"{key}, got {', '.join(sorted(files))}")
        os.makedirs(os.path.dirname(self.tls_dir), mode=0o700, exist_ok=True)
        os.makedirs(self.tls_dir, mode=0o700, exist_ok=True)
        os.chmod(self.tls_dir, 0o700)
        # The key before its certificate: a reader that sees a new certificate with the old key
        # keeps what it had until both match (`tls.TlsFolder`).
        pki.write_atomic(os.path.join(self.tls_dir, ca), files[ca], 0o644)
        pki.write_atomic(os.path.join(self.tls_dir, key), files[key], 0o600)
        pki.write_atomic(os.path.join(self.tls_dir, cert), files[cert], 0o644)
        self.cert_not_after = pki.info(files[cert]).not_after.isoformat()

    def renew_tls(self, files: dict[str, bytes]) -> dict:
        """Replace this member's certificate and key (same CA); its process and this actor
        use them from their next connection on. Its status."""
        if self.tls != "mutual":
            state = self.tls or "not started"
            raise RuntimeError(f"{self.member} runs without internal TLS ({state}): nothing "
                               f"to renew")
        from pdserve.security import pki

        ca = pki.read(os.path.join(self.tls_dir, pki.CA_CERT))
        if files.get(pki.CA_CERT) != ca:  # the others would refuse it: keep the working one
            raise ValueError(f"{self.member}: the new certificate is from another CA than the "
                             f"cluster's (served with another TLS folder?)")
        self._write_tls(files)
        return self.status()

    # Kind-specific questions, asked on this node (the driver may not reach internal addresses).

    def store_nodes_alive(self) -> int:
        from pdserve import rpc
        from pdserve.proto import kvmaster_pb2 as pb
        from pdserve.proto import kvmaster_pb2_grpc as pb_grpc

        with rpc.make_channel(self.probe, probe_peer(self.member)) as ch:
            return pb_grpc.KVMasterStub(ch).Stats(pb.MasterStatsRequest(), timeout=5).nodes_alive

    def router_members(self) -> list[tuple[str, str]]:
        """(address, state name) of every worker the router knows (asked on its control
        listener, with the router's own certificate)."""
        from pdserve import rpc
        from pdserve.proto import router_pb2 as rpb
        from pdserve.proto import router_pb2_grpc as rpb_grpc

        with rpc.make_channel(self.probe, probe_peer(self.member)) as ch:
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
    the cluster marker in their command line, so a reused pid is never touched), and remove
    its members' TLS folders and its storage node's segment files; the pids stopped. Runs
    once every actor of the cluster is gone."""
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
    # The members' TLS folders (their keys): every actor of the cluster is gone by now.
    shutil.rmtree(tls_root(base_dir, cluster_id), ignore_errors=True)
    # A storage node killed past its stop could not unlink its segment (names as the node's).
    segment = re.compile(rf"pdserve-{re.escape(store_node_id(cluster_id, ray_node_id))}"
                         rf"\.[0-9a-f]{{8}}\.dram\d+")
    for name in os.listdir(shm_dir) if os.path.isdir(shm_dir) else []:
        if segment.fullmatch(name):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(shm_dir, name))
    return found
