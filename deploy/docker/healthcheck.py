"""The image's HEALTHCHECK: is the pdserve process in this container serving?

Owns finding what to probe from the pdserve process's command line and environment (pure:
`find_pdserve` over the container's command lines, `probe_for` over one of them) and probing it
once: the standard gRPC health service of `pdserve serve` (its router, `--host`/`--port`) and of
`pdserve master|worker|router|controller` (`--address`, or `PDSERVE_<KIND>_ADDRESS`, the command
line winning as in `pdserve.entrypoints`), over the cluster's mutual TLS with the process's own
certificate (`--tls-dir`, `PDSERVE_<KIND>_TLS_DIR` or `PDSERVE_TLS_DIR`) unless it runs with
`--insecure-internal`; its plaintext `--health-address` when it has one; a TCP connect to a
storage node's `--data-address` (a node without a health address serves no gRPC).
`PDSERVE_HEALTH_ADDRESS=host:port` names a plaintext gRPC health address outright.
Exits 0 when healthy, 1 otherwise, with one line saying what was probed and what it answered.

Must not start, stop or signal any process, retry or sleep (Docker's `--retries` and `--interval`
do that), or import pdserve (a probe every few seconds must stay light: only grpc is imported).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

KINDS = ("serve", "master", "node", "worker", "router", "controller")
# Each kind's default listening address, as its parser has it (tests/deploy/test_docker.py checks
# these against the code). A storage node's data port 0 is chosen at start: nothing to connect to.
DEFAULT_ADDRESS = {
    "serve": "127.0.0.1:50051",
    "master": "127.0.0.1:50080",
    "node": "127.0.0.1:0",
    "worker": "127.0.0.1:50061",
    "router": "127.0.0.1:50051",
    "controller": "127.0.0.1:50052",
}
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True)
class Probe:
    how: str  # "grpc" (standard health, service ""), "tcp" (connect), "alive" (process found)
    address: str  # host:port to probe; "" for "alive"
    why: str  # where the address came from, for the report line
    # Mutual TLS: (the TLS folder, the process's kind) whose ca.crt and <kind>.crt/.key the
    # probe presents, checking the server is that kind; None: plaintext.
    tls: tuple[str, str] | None = None


def find_pdserve(cmdlines: Mapping[int, Sequence[str]]) -> tuple[int, str, list[str]] | None:
    """The pdserve process among `cmdlines` (pid -> argv): the lowest pid whose argv runs
    `pdserve KIND ...` (the console script, possibly behind its interpreter) or
    `python -m pdserve.cli KIND ...`; returns (pid, kind, the arguments after KIND)."""
    for pid in sorted(cmdlines):
        argv = list(cmdlines[pid])
        for i, arg in enumerate(argv[:-1]):
            script = os.path.basename(arg) == "pdserve"
            module = arg == "pdserve.cli" and i > 0 and argv[i - 1] == "-m"
            if (script or module) and argv[i + 1] in KINDS:
                return pid, argv[i + 1], argv[i + 2:]
    return None


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The last value given to `flag` in `args` (`--flag VALUE` or `--flag=VALUE`), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def _setting(kind: str, args: Sequence[str], env: Mapping[str, str], name: str) -> str | None:
    """A flag's value from the command line, else `PDSERVE_<KIND>_<NAME>` (entrypoints' rule)."""
    value = flag_value(args, "--" + name.lower().replace("_", "-"))
    return value if value is not None else env.get(f"PDSERVE_{kind.upper()}_{name}")


def _local(address: str) -> str:
    """`address` with a wildcard host replaced by loopback (where a probe inside reaches it)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address: want host:port, got {address!r}")
    return f"{'127.0.0.1' if host in _WILDCARD_HOSTS else host}:{port}"


def probe_for(kind: str, args: Sequence[str], env: Mapping[str, str]) -> Probe:
    """What to probe for a `pdserve KIND args...` process whose environment is `env`."""
    if kind not in KINDS:
        raise ValueError(f"kind: want one of {', '.join(KINDS)}, got {kind!r}")
    override = env.get("PDSERVE_HEALTH_ADDRESS", "").strip()
    if override:
        return Probe("grpc", _local(override), "PDSERVE_HEALTH_ADDRESS")
    if kind == "serve":  # the embedded cluster: its router is the front door
        default_host, default_port = DEFAULT_ADDRESS["serve"].rsplit(":", 1)
        host = flag_value(args, "--host") or default_host
        port = flag_value(args, "--port") or default_port
        how = "tcp" if flag_value(args, "--tls-cert") else "grpc"  # its own TLS: a connect
        return Probe(how, _local(f"{host}:{port}"), "serve --host/--port (the router)")
    health = _setting(kind, args, env, "HEALTH_ADDRESS")
    if health:
        return Probe("grpc", _local(health), "--health-address (plaintext health)")
    flag = "--data-address" if kind == "node" else "--address"
    variable = f"PDSERVE_{kind.upper()}_{flag[2:].upper().replace('-', '_')}"
    address, why = flag_value(args, flag), flag
    if address is None and env.get(variable):
        address, why = env[variable], variable
    if address is None:
        address, why = DEFAULT_ADDRESS[kind], f"the default {flag}"
    address = _local(address)
    if kind == "node":
        if address.endswith(":0"):
            return Probe("alive", "", "a node on a data port chosen at start")
        return Probe("tcp", address, why)
    if kind == "router":  # --address is its client port: plaintext unless it has its own TLS
        how = "tcp" if _setting(kind, args, env, "TLS_CERT") else "grpc"
        return Probe(how, address, why)
    insecure = "--insecure-internal" in args or env.get(
        f"PDSERVE_{kind.upper()}_INSECURE_INTERNAL") is not None or env.get(
        "PDSERVE_INSECURE_INTERNAL", "").lower() in ("1", "true", "yes")
    folder = _setting(kind, args, env, "TLS_DIR") or env.get("PDSERVE_TLS_DIR")
    if insecure or not folder:
        return Probe("grpc", address, why)
    return Probe("grpc", address, f"{why}, mutual TLS", (folder, kind))


def _cmdlines() -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                raw = f.read()
        except OSError:  # exited while we looked
            continue
        out[int(name)] = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    return out


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def _channel(address: str, tls: tuple[str, str] | None):
    import grpc

    if tls is None:
        return grpc.insecure_channel(address)
    folder, kind = tls

    def read(name: str) -> bytes:
        with open(os.path.join(folder, name), "rb") as f:
            return f.read()

    creds = grpc.ssl_channel_credentials(read("ca.crt"), read(f"{kind}.key"), read(f"{kind}.crt"))
    return grpc.secure_channel(address, creds, options=[
        ("grpc.ssl_target_name_override", f"{kind}.pdserve.internal")])


def _grpc_health(address: str, timeout_s: float,
                 tls: tuple[str, str] | None = None) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        channel = _channel(address, tls)
    except OSError as e:
        return False, f"cannot read the TLS folder: {e.strerror} ({e.filename})"
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def _tcp(address: str, timeout_s: float) -> tuple[bool, str]:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True, "accepts connections"
    except OSError as e:
        return False, f"connect failed: {e}"


def main() -> int:
    timeout_s = float(os.environ.get("PDSERVE_HEALTH_TIMEOUT_S", "3"))
    found = find_pdserve(_cmdlines())
    if found is None:
        print("unhealthy: no `pdserve <kind>` process in this container")
        return 1
    pid, kind, args = found
    # The process's own environment: the probe runs in a fresh `docker exec` environment.
    env = {**_environ(pid), **{k: v for k, v in os.environ.items()
                              if k == "PDSERVE_HEALTH_ADDRESS"}}
    try:
        probe = probe_for(kind, args, env)
    except ValueError as e:
        print(f"unhealthy: pdserve {kind} (pid {pid}): {e}")
        return 1
    if probe.how == "alive":
        ok, answer = True, "running"
    elif probe.how == "tcp":
        ok, answer = _tcp(probe.address, timeout_s)
    else:
        ok, answer = _grpc_health(probe.address, timeout_s, probe.tls)
    where = f" {probe.how} {probe.address}" if probe.address else ""
    print(f"{'healthy' if ok else 'unhealthy'}: pdserve {kind} (pid {pid}){where} "
          f"({probe.why}): {answer}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
