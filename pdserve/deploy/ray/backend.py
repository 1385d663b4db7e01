"""pdserve's processes on a Ray cluster: bring one up, tear it down, say how it stands.

Owns the Ray side: connecting to a running cluster (never starting a private one: if none is
reachable it says so and how to start one), sweeping what an earlier run of the same cluster
name left (named actors, placement groups, processes recorded by pid), the placement groups
(one `STRICT_PACK` group for the store master, router and controller; one named detached group
per worker with its CPU/GPU bundle), one detached named actor per process (`actor.ProcessHost`;
storage nodes pinned to each Ray node that hosts a worker), the start order and readiness
(master; storage nodes registered; workers serving and registered with the router; the router
serving; the controller), handing each actor its TLS bundle as it starts its process (from
`certs.Issuer`: the driver's CA never leaves the driver's machine), renewing the bundles of a
running cluster (`renew_certs`), and the stop order (router within its grace, controller,
workers, storage nodes, master; then the actors, the groups, a sweep of every node).

Must not write command lines or names (`plan.py`) nor run the processes (`actor.py`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.deploy.ray import certs, plan
from pdserve.deploy.ray.actor import ProcessHost, sweep_node
from pdserve.deploy.ray.plan import NAMESPACE, RaySpec, full_name, kind_of, member_of


class NoRayCluster(RuntimeError):
    pass


class RayStartError(RuntimeError):
    pass


def connect(address: str | None) -> None:
    """Join the Ray cluster at `address` (else $RAY_ADDRESS, else the one on this machine)."""
    import ray

    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        _probe(target)  # ray.init retries an address that does not answer for ever
        ray.init(address=target, namespace=NAMESPACE, log_to_driver=False,
                 logging_level=logging.WARNING)
    except (ConnectionError, TimeoutError, RuntimeError, OSError) as e:
        raise NoRayCluster(
            f"no Ray cluster reachable at {target!r} ({str(e).splitlines()[0]}); pdserve does "
            f"not start one for you: run `ray start --head` on one machine (and `ray start "
            f"--address HEAD_IP:6379` on the others), then pass --address HEAD_IP:6379 (or set "
            f"RAY_ADDRESS)") from None


def _probe(target: str, timeout_s: float = 5.0) -> None:
    """Raises ConnectionError unless the cluster's GCS port at `target` accepts a connection
    ("auto": the cluster last started on this machine, as Ray itself resolves it)."""
    if target.startswith("ray://"):  # Ray Client: its own connection checks
        return
    if target == "auto":
        try:  # Ray's own resolution of "auto" (/tmp/ray/ray_current_cluster); not public API
            from ray._private.services import canonicalize_bootstrap_address_or_die
        except ImportError:
            return  # ray.init resolves it (a stale record may make it wait)
        target = canonicalize_bootstrap_address_or_die("auto")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ConnectionError(f"not host:port: {target!r}")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConnectionError(f"{host}:{port} does not answer: {e.strerror or e}") from None


def _ray_error(e: BaseException) -> str:
    """The message of the error an actor method raised (not Ray's wrapping traceback)."""
    cause = getattr(e, "cause", None)
    return str(cause) if cause is not None else str(e).splitlines()[0]


class StartCancelled(RuntimeError):
    pass


_NEVER = threading.Event()  # a cancel that is never set


def _get(refs, timeout_s: float, what: str, cancel: threading.Event = _NEVER):
    """`ray.get` in short slices, so a stop signal (`cancel`) ends a long wait."""
    import ray

    pending = refs if isinstance(refs, list) else [refs]
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if cancel.is_set():
                raise StartCancelled(f"cancelled while waiting for {what}")
            left = deadline - time.monotonic()
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=max(0, min(0.5, left)))
            if not pending:
                return ray.get(refs)
            if left <= 0:
                raise RayStartError(f"{what}: no answer within {timeout_s:g}s")
    except ray.exceptions.RayError as e:
        raise RayStartError(f"{what}: {_ray_error(e)}") from None


@dataclass
class Deployment:
    cluster_id: str
    router: str  # host:port of the router's gRPC API
    http: str | None  # host:port of its OpenAI HTTP API
    controller: str | None
    control: str = ""  # host:port of the router's control API
    tls_dir: str = ""  # the driver's TLS folder (the operator's certificate); "": insecure
    members: dict[str, dict] = field(default_factory=dict)  # member -> its status at start


def up(spec: RaySpec, say: Callable[[str], None] = lambda _: None,
       cancel: threading.Event = _NEVER) -> Deployment:
    """Place and start every process; the addresses once the router serves every worker.
    On any failure everything started is torn down and RayStartError says what failed
    (StartCancelled once `cancel` is set). Internal TLS (unless the spec is insecure): the
    CA of the spec's `tls_dir`, else the driver's own folder of this cluster name."""
    cid = spec.cluster_id
    issuer = None if spec.cluster.insecure_internal else certs.issuer(
        cid, spec.cluster.tls_dir, say=say)
    swept = down(cid, spec.base_dir, grace_s=0.0)
    if any(swept.values()):
        say(f"swept an earlier run of cluster {cid}: {swept}")
    try:
        return _up(spec, issuer, say, cancel)
    except BaseException:
        down(cid, spec.base_dir, grace_s=0.0)
        raise


def _up(spec: RaySpec, issuer: certs.Issuer | None, say: Callable[[str], None],
        cancel: threading.Event) -> Deployment:
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import (NodeAffinitySchedulingStrategy,
                                                PlacementGroupSchedulingStrategy)

    s, cid, timeout = spec.cluster, spec.cluster_id, spec.cluster.ready_timeout_s

    def get(refs, timeout_s: float, what: str):
        return _get(refs, timeout_s, what, cancel)

    run_dir = os.path.join(spec.base_dir, cid, time.strftime("run-%Y%m%d-%H%M%S"))
    why = plan.unplaceable(spec, [n["Resources"] for n in ray.nodes() if n.get("Alive")])
    if why is not None:  # known now: do not wait out the ready timeout to say it
        raise RayStartError(f"cannot place the cluster: {why}")
    groups = {plan.CONTROL_PG: placement_group(
        spec.control_bundles(), strategy="STRICT_PACK", name=full_name(cid, plan.CONTROL_PG),
        lifetime="detached")}
    for member, role in spec.worker_members():
        groups[member] = placement_group([spec.worker_bundle(role)], strategy="STRICT_PACK",
                                         name=full_name(cid, member), lifetime="detached")
    say(f"placing {len(groups)} placement groups")
    _wait_groups(groups, timeout, cancel)

    host_cls = ray.remote(ProcessHost)
    policy = s.restart_policy if s.supervise else None

    def host(member: str, strategy, **resources):
        return host_cls.options(
            name=full_name(cid, member), namespace=NAMESPACE, lifetime="detached",
            max_concurrency=8, max_restarts=0, scheduling_strategy=strategy, **resources
        ).remote(cid, member, kind_of(member), spec.base_dir, policy)

    hosts = {}
    for i, member in enumerate(spec.control_members()):
        hosts[member] = host(member, PlacementGroupSchedulingStrategy(groups[plan.CONTROL_PG], i),
                             num_cpus=spec.control_cpus, resources=dict(spec.control_resources))
    for member, role in spec.worker_members():
        b = spec.worker_bundle(role)
        hosts[member] = host(member, PlacementGroupSchedulingStrategy(groups[member], 0),
                             num_cpus=b.pop("CPU"), num_gpus=b.pop("GPU", 0), resources=b)
    workers = [m for m, _ in spec.worker_members()]
    worker_nodes = sorted({n["node_id"] for n in get([hosts[m].node.remote() for m in workers],
                                                      timeout, "worker actors")})
    for node_id in worker_nodes:
        hosts[plan.store_member(node_id)] = host(
            plan.store_member(node_id), NodeAffinitySchedulingStrategy(node_id, soft=False),
            num_cpus=0)
    info = dict(zip(hosts, get([h.node.remote() for h in hosts.values()], timeout, "actors")))
    ports = dict(zip(hosts, get([h.free_ports.remote(3) for h in hosts.values()], timeout,
                                 "free ports")))

    def addr(member: str, port: int) -> str:
        return f"{info[member]['ip']}:{port}"

    def start(member: str, args: list[str], address: str, probe: str = ""):
        files = None if issuer is None else issuer.bundle(member, kind_of(member))
        return hosts[member].start.remote(args, address, run_dir, probe, files)

    def ready(members: list[str], what: str) -> None:
        get([hosts[m].wait_ready.remote(timeout) for m in members], timeout + 30, what)

    master = addr("master", ports["master"][0])
    get(start("master", plan.master_args(spec, master, os.path.join(run_dir, "kvmaster-journal")),
               master), 60, "store master")
    ready(["master"], "store master")
    nodes = [plan.store_member(n) for n in worker_nodes]
    get([start(m, plan.node_args(spec, info[m]["node_id"], info[m]["ip"], master), "")
          for m in nodes], 60, "storage nodes")
    ready(nodes, "storage nodes")
    _until(lambda: get(hosts["master"].store_nodes_alive.remote(), 30, "store master")
           >= len(nodes), timeout, f"{len(nodes)} storage nodes registered with {master}", cancel)

    # The client ports bind what --host / --http-host say (127.0.0.1 unless told: closed by
    # default, as `pdserve serve`); the control port, which workers reach, the node's IP.
    router = f"{s.host}:{s.router_port or ports['router'][0]}"
    http = None if s.http_port is None else f"{s.http_host}:{s.http_port or ports['router'][1]}"
    control = addr("router", s.router_control_port or ports["router"][2])
    refs = [start("router", plan.router_args(spec, router, http, control, master), router,
                  control)]
    addresses = {m: addr(m, ports[m][0]) for m in workers}
    for member, role in spec.worker_members():
        a = addresses[member]
        refs.append(start(member, plan.worker_args(spec, member, role, a, info[member]["node_id"],
                                                   master, ports[member][1]), a))
    get(refs, 60, "router and workers")
    say(f"loading the model on {len(workers)} workers")
    ready(workers, "workers")
    ready(["router"], "router")

    def all_joined() -> bool:
        members = dict(get(hosts["router"].router_members.remote(), 30, "router"))
        return all(members.get(a) == "MEMBER_STATE_ACTIVE" for a in addresses.values())

    _until(all_joined, timeout, f"every worker registered with the router at {control}", cancel)
    controller = None
    if s.controller:
        controller = addr("controller", s.controller_port or ports["controller"][0])
        get(start("controller", plan.controller_args(
            spec, controller, control, master, os.path.join(run_dir, "controller-audit.jsonl"),
            ports["controller"][1]), controller), 60, "controller")
        ready(["controller"], "controller")
    statuses = get([h.status.remote() for h in hosts.values()], 30, "status")
    return Deployment(cid, router, http, controller, control,
                      "" if issuer is None else issuer.folder, dict(zip(hosts, statuses)))


def _wait_groups(groups: dict, timeout_s: float, cancel: threading.Event) -> None:
    import ray

    refs = {g.ready(): m for m, g in groups.items()}
    pending, deadline = list(refs), time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline and not cancel.is_set():
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
    if cancel.is_set():
        raise StartCancelled("cancelled while placing the placement groups")
    if pending:
        names = ", ".join(f"{refs[r]} {groups[refs[r]].bundle_specs}" for r in pending)
        raise RayStartError(f"placement groups not placed within {timeout_s:g}s: {names}; the "
                            f"cluster has {ray.available_resources()} available (see "
                            f"--ray-worker-cpus, --ray-worker-gpus, --ray-*-resources)")


def _until(check: Callable[[], bool], timeout_s: float, what: str,
           cancel: threading.Event = _NEVER) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if cancel.is_set():
            raise StartCancelled(f"cancelled while waiting for {what}")
        if time.monotonic() > deadline:
            raise RayStartError(f"not ready within {timeout_s:g}s: {what}")
        time.sleep(0.2)


# Teardown and status, by cluster name (any driver: the one that started it may be gone).

def _hosts(cluster_id: str) -> dict:
    import ray

    out = {}
    for name in ray.util.list_named_actors():
        member = member_of(cluster_id, name)
        if member is not None:
            try:
                out[member] = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:  # gone meanwhile
                pass
    return out


def groups(cluster_id: str) -> list[plan.GroupInfo]:
    from ray.util import placement_group_table

    out = []
    for g in placement_group_table().values():
        if member_of(cluster_id, g.get("name", "")) is not None and g["state"] != "REMOVED":
            nodes = g.get("bundles_to_node_id", {})
            out.append(plan.GroupInfo(g["name"], g["state"],
                                      tuple(nodes.get(i, "") for i in sorted(g["bundles"]))))
    return out


def down(cluster_id: str, base_dir: str, grace_s: float = 30.0, timeout_s: float = 10.0) -> dict:
    """Stop every process of the cluster in order, then remove its actors and placement groups
    and sweep every node for processes whose actor is gone. Counts of what was found."""
    import ray
    from ray.util import get_placement_group, remove_placement_group

    hosts = _hosts(cluster_id)
    for kind in plan.STOP_ORDER:
        wait_s = grace_s + timeout_s if kind == "router" else timeout_s
        refs = [h.stop.remote(wait_s) for m, h in hosts.items() if kind_of(m) == kind]
        ray.wait(refs, num_returns=len(refs), timeout=wait_s + 20)  # dead actors answer errors
    for h in hosts.values():
        ray.kill(h, no_restart=True)
    found = groups(cluster_id)
    for g in found:
        try:
            remove_placement_group(get_placement_group(g.name))
        except ValueError:  # removed meanwhile
            pass
    sweep = ray.remote(sweep_node)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    refs = [sweep.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote(base_dir, cluster_id, n["NodeID"], timeout_s)
        for n in ray.nodes() if n["Alive"]]
    pids = [p for r in _get(refs, timeout_s + 120, "sweeping the nodes") for p in r]
    return {"actors": len(hosts), "placement_groups": len(found), "stray_processes": len(pids)}


def status(cluster_id: str, timeout_s: float = 10.0) -> tuple[list[tuple[str, ...]], dict]:
    """The status table's rows and the live members' raw status (member -> dict)."""
    import ray

    refs = {m: h.status.remote() for m, h in _hosts(cluster_id).items()}
    live = {}
    for member, ref in refs.items():
        try:
            live[member] = ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            live[member] = {"state": "actor not answering"}
        except ray.exceptions.RayError:  # died between the listing and the call
            pass
    expected = plan.expected_members(cluster_id, groups(cluster_id))
    return plan.status_rows(expected, live), live


def clusters() -> list[str]:
    """Names of the pdserve clusters with a control placement group on this Ray cluster."""
    from ray.util import placement_group_table

    names = {g.get("name", "") for g in placement_group_table().values()
             if g["state"] != "REMOVED"}
    suffix = "-" + plan.CONTROL_PG
    return sorted(n[len("pdserve-"):-len(suffix)] for n in names
                  if n.startswith("pdserve-") and n.endswith(suffix))


def renew_certs(cluster_id: str, issuer: certs.Issuer, timeout_s: float = 30.0
                ) -> dict[str, str]:
    """Hand every live member of the cluster a new bundle from `issuer`; its process uses it
    from its next connection on (no restart). Member -> when its new certificate ends, or
    "error: ..." naming why it was not renewed."""
    import ray

    refs = {m: h.renew_tls.remote(issuer.bundle(m, kind_of(m)))
            for m, h in _hosts(cluster_id).items()}
    out = {}
    for member, ref in refs.items():
        try:
            out[member] = ray.get(ref, timeout=timeout_s)["cert_not_after"]
        except ray.exceptions.GetTimeoutError:
            out[member] = f"error: no answer within {timeout_s:g}s"
        except ray.exceptions.RayError as e:
            out[member] = f"error: {_ray_error(e)}"
    return out
