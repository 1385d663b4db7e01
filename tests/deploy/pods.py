"""Rendered pods run as local processes: a stand-in for a kubelet and cluster DNS on loopback.

Owns turning the chart's workloads into pods (StatefulSet ordinals, Deployment replicas, or
the minReplicas of the HorizontalPodAutoscaler that owns a Deployment's count), what
the kubelet does for a container (the downward API in env and volumes, `$(VAR)` expansion,
command + args, volumes as directories: emptyDirs made empty, a hostPath its own host path,
a Secret's keys written as its `items` say with their modes, a missing Secret or key failing
the pod as it would keep the pod from starting; mount paths in a command line or variable
rewritten to those directories), and what cluster networking does: every pod gets a
fake pod IP and its own free loopback port per declared container port, and every address in a
command line or variable is rewritten to a loopback address: `0.0.0.0:P` and a pod IP to that
pod's own port; `<service>.<ns>.svc.<domain>:P` and `<pod>.<service>.<ns>.svc.<domain>:P` to a
proxy that, like kube-proxy and cluster DNS, forwards a connection only to a pod whose probes
say ready (or any selected pod when the Service publishes not-ready addresses) and refuses it
otherwise. An address that names this cluster but resolves to nothing (no such Service, a port
no Service or container declares, a pod DNS name its Service does not give) fails the test:
that is a wiring mistake in the chart. Also probes (gRPC health in plaintext, TCP) as the
kubelet would run them, and a minimal Kubernetes API (list pods, patch labels) for the
controller pod's label sync. A pod's environment is the test process's (the image's
stand-in) less its internal TLS settings, which only the chart gives. Must not know pdserve's
flags beyond `--port` and `--*-port` taking a bare port.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from pdserve import rpc
from tests.deploy.chart import argv as container_argv
from tests.deploy.chart import container_port, matches, of_kind
from tests.helpers import REPO_ROOT, free_port

_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
# Variables of the test process a pod must not inherit: its TLS is what the chart mounts.
_HOST_ONLY_ENV = ("PDSERVE_TLS_DIR", "PDSERVE_INSECURE_INTERNAL")
_ADDRESS = re.compile(r"(?<![\w.-])([A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):(\d{1,5})(?!\d)")


@dataclass
class Pod:
    name: str
    workload: dict
    ip: str
    ports: dict[int, int]  # containerPort -> loopback port
    dirs: dict[str, str] = field(default_factory=dict)  # volume name -> local directory
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)  # container -> process
    logs: dict[str, str] = field(default_factory=dict)
    argv: dict[str, list[str]] = field(default_factory=dict)  # container -> command line run

    @property
    def labels(self) -> dict[str, str]:
        return self.workload["spec"]["template"]["metadata"]["labels"]

    @property
    def spec(self) -> dict:
        return self.workload["spec"]["template"]["spec"]

    def container(self, name: str) -> dict:
        return next(c for c in self.spec["containers"] if c["name"] == name)


def _quantity(text: str) -> float:
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text))
    assert m and m.group(2) in ("", *units), f"quantity {text!r}"
    return float(m.group(1)) * units.get(m.group(2), 1)


class FakeCluster:
    """`secrets`: the namespace's Secrets the pods may mount, name -> key -> bytes."""

    def __init__(self, objs: list[dict], namespace: str, workdir: Path,
                 domain: str = "cluster.local",
                 secrets: dict[str, dict[str, bytes]] | None = None) -> None:
        self.objs, self.namespace, self.domain, self.workdir = objs, namespace, domain, workdir
        self.secrets = secrets or {}
        self.services = {s["metadata"]["name"]: s for s in of_kind(objs, "Service")}
        self.proxies: dict[tuple[str, int], _Proxy] = {}
        self.pods: dict[str, Pod] = {}
        scaled = {(h["spec"]["scaleTargetRef"]["kind"], h["spec"]["scaleTargetRef"]["name"]):
                  h["spec"].get("minReplicas", 1)
                  for h in of_kind(objs, "HorizontalPodAutoscaler")}
        for w in [o for o in objs if o["kind"] in ("StatefulSet", "Deployment")]:
            # No replicas: Kubernetes' 1, which an autoscaler raises to its minimum.
            replicas = w["spec"].get("replicas", scaled.get((w["kind"], w["metadata"]["name"]), 1))
            for i in range(replicas):
                name = (f"{w['metadata']['name']}-{i}" if w["kind"] == "StatefulSet"
                        else f"{w['metadata']['name']}-6f7c9d-{i}")
                ports = {p["containerPort"]: free_port()
                         for c in w["spec"]["template"]["spec"]["containers"]
                         for p in c.get("ports", [])}
                self.pods[name] = Pod(name, w, f"10.77.0.{len(self.pods) + 2}", ports)
        self.bin = workdir / "bin"  # `pdserve` and `python` as the image has them
        self.bin.mkdir(parents=True, exist_ok=True)
        (self.bin / "pdserve").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pdserve.cli "$@"\n')
        (self.bin / "pdserve").chmod(0o755)
        if not (self.bin / "python").exists():
            (self.bin / "python").symlink_to(sys.executable)

    def pods_of(self, component: str) -> list[Pod]:
        return [p for p in self.pods.values()
                if p.labels["app.kubernetes.io/component"] == component]

    # ---- cluster DNS and Services -------------------------------------------------------------

    def _pod_port(self, pod: Pod, port: int, what: str) -> int:
        assert port in pod.ports, f"{what}: port {port} is not a container port of {pod.name}"
        return pod.ports[port]

    def resolve(self, host: str, port: int, own: Pod) -> int | None:
        """The loopback port `host:port` reaches from `own`, None if it is not a cluster name."""
        what = f"{host}:{port} (in {own.name})"
        if host == "0.0.0.0":
            return self._pod_port(own, port, what)
        for pod in self.pods.values():
            if host == pod.ip:
                return self._pod_port(pod, port, what)
        for suffix in (f".{self.namespace}.svc.{self.domain}", f".{self.namespace}.svc"):
            if host.endswith(suffix):
                return self._resolve_name(host[:-len(suffix)].split("."), port, what)
        return None

    def _resolve_name(self, labels: list[str], port: int, what: str) -> int:
        svc = self.services.get(labels[-1])
        assert svc is not None and len(labels) <= 2, f"{what}: no such Service"
        selected = [p for p in self.pods.values() if matches(svc["spec"]["selector"], p.labels)]
        assert selected, f"{what}: Service {labels[-1]} selects no pod"
        if len(labels) == 2:  # <pod>.<service>: a StatefulSet pod's own DNS name
            pod = self.pods.get(labels[0])
            assert pod in selected, f"{what}: {labels[-1]} does not select pod {labels[0]}"
            assert svc["spec"].get("clusterIP") == "None", f"{what}: {labels[-1]} not headless"
            assert pod.workload["spec"].get("serviceName") == labels[-1], \
                f"{what}: pod {pod.name} gets no DNS name under {labels[-1]}"
            self._pod_port(pod, port, what)
            endpoints = [(pod, port)]
        else:
            ports = [p for p in svc["spec"]["ports"] if p["port"] == port]
            assert len(ports) == 1, f"{what}: Service {labels[-1]} has no port {port}"
            endpoints = []
            for pod in selected:
                target = container_port(pod.workload, ports[0]["targetPort"])
                assert target is not None, \
                    f"{what}: targetPort {ports[0]['targetPort']} not declared by {pod.name}"
                endpoints.append((pod, target))
        key = (".".join(labels), port)
        if key not in self.proxies:
            self.proxies[key] = _Proxy(self, endpoints,
                                       bool(svc["spec"].get("publishNotReadyAddresses")))
        return self.proxies[key].port

    def ready(self, pod: Pod) -> bool:
        """Every container of `pod` started and passing its readiness probe (if it has one)."""
        return all(name in pod.procs and pod.procs[name].poll() is None and
                   ("readinessProbe" not in c or self.probe(pod, name, "readinessProbe"))
                   for name, c in ((c["name"], c) for c in pod.spec["containers"]))

    def rewrite(self, text: str, own: Pod) -> str:
        def sub(m: re.Match) -> str:
            port = self.resolve(m.group(1), int(m.group(2)), own)
            return m.group(0) if port is None else f"127.0.0.1:{port}"
        return _ADDRESS.sub(sub, text)

    # ---- the kubelet ---------------------------------------------------------------------------

    def _env(self, pod: Pod, c: dict) -> dict[str, str]:
        env = {"HOSTNAME": pod.name}
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), e["value"])
                continue
            ref = e["valueFrom"]
            if "fieldRef" in ref:
                path = ref["fieldRef"]["fieldPath"]
                env[e["name"]] = {"metadata.name": pod.name, "metadata.namespace": self.namespace,
                                  "status.podIP": pod.ip}[path]
            else:
                r = ref["resourceFieldRef"]
                group, _, resource = r["resource"].partition(".")
                amount = _quantity(pod.container(r.get("containerName", c["name"]))
                                   ["resources"][group][resource])
                env[e["name"]] = str(math.ceil(amount / _quantity(r.get("divisor", "1"))))
        return env

    def _volumes(self, pod: Pod) -> None:
        for v in pod.spec.get("volumes", []):
            if "hostPath" in v:  # the node's own path: the test's host is the node
                path = v["hostPath"]["path"]
                assert os.path.exists(path), f"{pod.name}: hostPath {path} does not exist"
                pod.dirs[v["name"]] = path
                continue
            base = Path("/dev/shm") if v.get("emptyDir", {}).get("medium") == "Memory" and \
                os.access("/dev/shm", os.W_OK) else self.workdir
            d = base / f"pdserve-test-{os.getpid()}-{pod.name}-{v['name']}"
            d.mkdir(parents=True, exist_ok=True)
            for item in v.get("downwardAPI", {}).get("items", []):
                assert item["fieldRef"]["fieldPath"] == "metadata.labels"
                (d / item["path"]).write_text("".join(
                    f'{k}="{val}"\n' for k, val in sorted(pod.labels.items())))
            if "secret" in v:
                self._secret_volume(pod, v["name"], v["secret"], d)
            pod.dirs[v["name"]] = str(d)

    def _secret_volume(self, pod: Pod, volume: str, spec: dict, d: Path) -> None:
        """A Secret's keys as files: each of `items` (key -> path, its own mode or the
        volume's defaultMode), else every key. A missing Secret or key keeps the pod from
        starting (unless the volume is optional), as the kubelet would."""
        what = f"{pod.name}: volume {volume}"
        data = self.secrets.get(spec["secretName"])
        if data is None:
            assert spec.get("optional"), f"{what}: no Secret {spec['secretName']}"
            return
        items = spec.get("items") or [{"key": k, "path": k} for k in sorted(data)]
        for item in items:
            if item["key"] not in data:
                assert spec.get("optional"), \
                    f"{what}: Secret {spec['secretName']} has no key {item['key']}"
                continue
            path = d / item["path"]
            assert d.resolve() in path.resolve().parents, \
                f"{what}: item path {item['path']} leaves the volume"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data[item["key"]])
            path.chmod(item.get("mode", spec.get("defaultMode", 0o644)))

    def command(self, pod: Pod, name: str) -> tuple[list[str], dict[str, str]]:
        """What a container runs (argv, its own variables), addresses and mounts made local."""
        c = pod.container(name)
        if not pod.dirs:
            self._volumes(pod)
        env = self._env(pod, c)
        words = [_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), w) for w in container_argv(c)]
        where = {m["mountPath"].rstrip("/") or "/": pod.dirs[m["name"]]
                 for m in c.get("volumeMounts", [])}
        # One pass, so a directory put in is never rewritten again (the test's directories
        # are under /tmp, a mount path too); a mount path only where a path starts and ends
        # (`/tmp` in `/tmp/x` or `TMPDIR=/tmp`, not in `/var/tmp` or `/tmpfs`); text already
        # under the test's own directory left as it is. Longest first: a mount inside
        # another wins.
        keep = str(self.workdir).rstrip("/")
        paths = sorted(where, key=len, reverse=True)
        alternatives = "|".join(map(re.escape, paths)) or r"(?!)"  # (?!): no mount
        pattern = re.compile(r"(?<![\w./-])(?:(" + re.escape(keep) + r")|(" + alternatives +
                             r"))(?![\w.-])")

        def local(text: str) -> str:
            text = pattern.sub(lambda m: m.group(0) if m.group(1) else where[m.group(2)], text)
            return self.rewrite(text, pod)

        out = []
        for i, w in enumerate(words):
            if i and re.fullmatch(r"--(?:[a-z-]+-)?port", words[i - 1]) and w.isdigit():
                w = str(self._pod_port(pod, int(w), f"{words[i - 1]} {w} in {pod.name}"))
            out.append(local(w))
        return out, {k: local(v) for k, v in env.items()}

    def start(self, pod: Pod, name: str, extra: list[str] = ()) -> subprocess.Popen:
        words, env = self.command(pod, name)
        host = {k: v for k, v in os.environ.items() if k not in _HOST_ONLY_ENV}
        # The compiled CPU kernels shared with the test process, as an image would hold them
        # (each pod's HOME is its own directory, which would compile them once per pod); the
        # chart's own PDSERVE_CACHE would win.
        host.setdefault("PDSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache",
                                                      "pdserve"))
        full_env = {**host, "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
                    "PYTHONPATH": str(REPO_ROOT), **env}
        log = self.workdir / f"{pod.name}.{name}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(words + list(extra), cwd=REPO_ROOT, env=full_env, stdout=f,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        pod.procs[name], pod.logs[name] = proc, str(log)
        pod.argv[name] = words + list(extra)
        return proc

    def running_argv(self, pod: Pod, name: str) -> list[str]:
        """The command line container `name` of `pod` runs now (after its start script's
        `exec`), as the process table has it; what was started where there is no /proc."""
        proc = pod.procs[name]
        try:
            raw = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        except OSError:
            return pod.argv[name]
        return [w.decode(errors="replace") for w in raw.split(b"\0")[:-1]]

    def probe(self, pod: Pod, name: str, kind: str) -> bool:
        """One run of the container's probe `kind`, as the kubelet would (on the pod's ports)."""
        p = pod.container(name)[kind]
        if "grpc" in p:
            address = f"127.0.0.1:{self._pod_port(pod, p['grpc']['port'], kind)}"
            try:
                # The kubelet's gRPC probe speaks plaintext: PUBLIC is a plaintext channel.
                rpc.wait_healthy(address, timeout_s=1.0, service=p["grpc"].get("service", ""),
                                 peer=rpc.PUBLIC)
                return True
            except TimeoutError:
                return False
        port = container_port(pod.workload, p["tcpSocket"]["port"])
        try:
            socket.create_connection(("127.0.0.1", self._pod_port(pod, port, kind)), 1).close()
            return True
        except OSError:
            return False

    def wait(self, pod: Pod, name: str, kind: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.probe(pod, name, kind):
            proc = pod.procs[name]
            assert proc.poll() is None, \
                f"{pod.name}/{name} exited {proc.returncode}:\n{self.tail(pod, name)}"
            assert time.monotonic() < deadline, \
                f"{pod.name}/{name}: {kind} not passing after {timeout_s}s:\n{self.tail(pod, name)}"
            time.sleep(0.2)

    def tail(self, pod: Pod, name: str, n: int = 30) -> str:
        return "".join(Path(pod.logs[name]).read_text(errors="replace").splitlines(True)[-n:])

    def stop_all(self, timeout_s: float = 10.0) -> None:
        procs = [p for pod in self.pods.values() for p in pod.procs.values()]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for proxy in self.proxies.values():
            proxy.close()
        for pod in self.pods.values():
            for d in pod.dirs.values():
                if d.startswith("/dev/shm/"):
                    subprocess.run(["rm", "-rf", d], check=False)


class _Proxy:
    """One Service address: each connection goes to a ready endpoint (any selected one when
    the Service publishes not-ready addresses), or is closed at once when there is none."""

    def __init__(self, cluster: FakeCluster, endpoints: list[tuple[Pod, int]],
                 not_ready_too: bool) -> None:
        self.cluster, self.endpoints, self.not_ready_too = cluster, endpoints, not_ready_too
        reserved = {p for pod in cluster.pods.values() for p in pod.ports.values()}
        held = []
        while True:  # not a port a pod will bind later
            self.listener = socket.create_server(("127.0.0.1", 0))
            self.port = self.listener.getsockname()[1]
            if self.port not in reserved:
                break
            held.append(self.listener)
        for s in held:
            s.close()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        ready = [(pod, port) for pod, port in self.endpoints
                 if pod.procs and (self.not_ready_too or self.cluster.ready(pod))]
        if not ready:
            conn.close()
            return
        pod, port = ready[0]
        try:
            upstream = socket.create_connection(("127.0.0.1", pod.ports[port]), timeout=5)
        except OSError:
            conn.close()
            return
        upstream.settimeout(None)
        for a, b in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self.listener.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class FakeKubeApi:
    """The two calls of the Kubernetes API the label sync makes: list pods by label selector,
    merge-patch a pod's labels. Pods: name -> labels."""

    def __init__(self, namespace: str, pods: dict[str, dict[str, str]]) -> None:
        self.namespace, self.pods, self.patches = namespace, pods, []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, code: int, doc: dict) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                url = urllib.parse.urlparse(self.path)
                if url.path != f"/api/v1/namespaces/{api.namespace}/pods":
                    return self._send(404, {"kind": "Status", "code": 404})
                query = urllib.parse.parse_qs(url.query).get("labelSelector", [""])[0]
                want = dict(kv.split("=", 1) for kv in query.split(",") if kv)
                self._send(200, {"kind": "PodList", "items": [
                    {"metadata": {"name": n, "labels": dict(ls)}}
                    for n, ls in sorted(api.pods.items()) if matches(want, ls)]})

            def do_PATCH(self) -> None:
                name = self.path.rpartition("/")[2]
                if self.headers["Content-Type"] != "application/merge-patch+json" or \
                        name not in api.pods:
                    return self._send(415 if name in api.pods else 404, {"kind": "Status"})
                patch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                api.pods[name].update(patch["metadata"]["labels"])
                api.patches.append((name, patch))
                self._send(200, {"metadata": {"name": name, "labels": api.pods[name]}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
