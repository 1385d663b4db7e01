"""What a pdserve cluster on Ray is made of, as a pure core: names, bundles, command lines.

Owns the `RaySpec` (the local `ClusterSpec` plus where things go on Ray: each worker's CPU/GPU
bundle and custom resources per role, the control processes' bundles, the storage nodes' DRAM),
the naming rule (actor and placement group `pdserve-<cluster>-<member>`, namespace `pdserve`;
`member_of` reads a name back unambiguously), the command line of every process
(`pdserve master|node|worker|router|controller ...`, from the same configs and the same
functions as the local launcher's, `launcher/commands.py`, bound to the Ray node's IP: the
router's client port and its control listener, which the workers register with and the
controller steers; and the internal TLS of each: `--tls-dir` the member's own folder on its
node, `member_tls_dir`, or `--insecure-internal` when the spec says so), where each process
answers health and which kind serves there (`probe_peer`), which members a cluster is expected
to have given its placement groups (so a dead actor still shows in a status), and the status
table's rows.

Must not import Ray, start anything or read a clock: `backend.py` does the I/O.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.launcher.cluster_spec import ClusterSpec
from pdserve.launcher.commands import (as_cli, command, controller_config, router_config,
                                       worker_config)
from pdserve.core.errors import ConfigError
from pdserve.kvstore.master.config import MasterConfig
from pdserve.kvstore.node.config import NodeConfig

NAMESPACE = "pdserve"
CONTROL_PG = "control"  # the placement group of the store master, the router, the controller
CONTROL_MEMBERS = ("master", "router", "controller")
STOP_ORDER = ("router", "controller", "worker", "node", "master")  # as the local launcher
# A member's name: kvnode-<first 12 hex digits of its Ray node id>, prefill-<i>, decode-<i>.
_MEMBER = re.compile(r"(master|router|controller|control|kvnode-[0-9a-f]{12}|(prefill|decode)-\d+)")
_RESOURCE = re.compile(r"[A-Za-z_][A-Za-z0-9_.:/-]{0,63}")


class RaySpecError(ConfigError):
    """A Ray deployment setting is invalid; the message names the setting."""


@dataclass(frozen=True)
class RaySpec:
    cluster: ClusterSpec  # model, worker counts, router/controller/spec flags; cluster_id: the name
    worker_cpus: float = 1.0  # per worker bundle
    worker_gpus: float = 0.0  # per worker bundle; Ray's GPU ids become CUDA_VISIBLE_DEVICES
    prefill_resources: Mapping[str, float] = field(default_factory=dict)  # custom, per worker
    decode_resources: Mapping[str, float] = field(default_factory=dict)
    control_cpus: float = 0.5  # per control process (master, router, controller)
    control_resources: Mapping[str, float] = field(default_factory=dict)  # per control bundle
    store_dram_bytes: int = 1 << 30  # each storage node's shared-memory DRAM segment
    # On every Ray node: logs, journal, pid files, each member's TLS folder.
    base_dir: str = "/tmp/pdserve-ray"

    def __post_init__(self) -> None:
        if not self.cluster.cluster_id:
            raise RaySpecError("cluster: a cluster name is required on Ray (--cluster)")
        if not self.worker_cpus > 0:
            raise RaySpecError(f"ray_worker_cpus must be > 0, got {self.worker_cpus}")
        if not self.worker_gpus >= 0:
            raise RaySpecError(f"ray_worker_gpus must be >= 0, got {self.worker_gpus}")
        if not self.control_cpus > 0:
            raise RaySpecError(f"ray_control_cpus must be > 0, got {self.control_cpus}")
        if self.store_dram_bytes < 1 << 20:
            raise RaySpecError(f"ray_store_dram_bytes must be >= 1 MiB, got "
                               f"{self.store_dram_bytes}")
        if not self.base_dir.startswith("/"):
            raise RaySpecError(f"ray_dir must be an absolute path, got {self.base_dir!r}")
        for what in ("prefill_resources", "decode_resources", "control_resources"):
            check_resources(f"ray_{what}", getattr(self, what))

    @property
    def cluster_id(self) -> str:
        return self.cluster.cluster_id

    def worker_members(self) -> list[tuple[str, str]]:
        """(member, role) of every worker, prefill first, numbered as the local launcher."""
        c = self.cluster
        roles = ["prefill"] * c.prefill_workers + ["decode"] * c.decode_workers
        return [(f"{role}-{i}", role) for i, role in enumerate(roles)]

    def control_members(self) -> tuple[str, ...]:
        return CONTROL_MEMBERS if self.cluster.controller else CONTROL_MEMBERS[:2]

    def control_bundles(self) -> list[dict[str, float]]:
        return [{"CPU": self.control_cpus, **self.control_resources}
                for _ in self.control_members()]

    def worker_bundle(self, role: str) -> dict[str, float]:
        extra = self.prefill_resources if role == "prefill" else self.decode_resources
        gpus = {"GPU": self.worker_gpus} if self.worker_gpus else {}
        return {"CPU": self.worker_cpus, **gpus, **extra}

    def worker_threads(self) -> int:
        return self.cluster.threads_per_worker or max(1, int(self.worker_cpus))


def unplaceable(spec: RaySpec, nodes: Sequence[Mapping[str, float]]) -> str | None:
    """Why the spec's placement groups (the control group's bundles on one node, each worker's
    on one) can never be placed on alive nodes with these total resources, with the arithmetic
    and the flags to change; None when the totals and the largest node allow it (Ray may still
    wait for resources other work holds)."""
    groups = [("the store master, router and controller", spec.control_bundles())]
    groups += [(member, [spec.worker_bundle(role)]) for member, role in spec.worker_members()]
    if not nodes:
        return "the Ray cluster has no alive node"
    need: dict[str, float] = {}
    for _, bundles in groups:
        for b in bundles:
            for k, v in b.items():
                need[k] = need.get(k, 0.0) + v
    for k, v in sorted(need.items()):
        have = sum(n.get(k, 0.0) for n in nodes)
        if v > have + 1e-9:
            workers = spec.cluster.prefill_workers + spec.cluster.decode_workers
            return (f"the placement groups need {v:g} {k} in all ({workers} workers x "
                    f"{spec.worker_bundle('decode').get(k, 0):g} + "
                    f"{len(spec.control_bundles())} control processes x "
                    f"{spec.control_bundles()[0].get(k, 0):g}) and the Ray cluster has {have:g}"
                    f" ({len(nodes)} nodes): lower --ray-worker-cpus / --ray-control-cpus (or"
                    f" the GPUs and resources asked), or add nodes")
    for what, bundles in groups:
        group = {k: sum(b.get(k, 0.0) for b in bundles) for k in need}
        if not any(all(n.get(k, 0.0) + 1e-9 >= v for k, v in group.items()) for n in nodes):
            asked = ", ".join(f"{v:g} {k}" for k, v in group.items() if v)
            return (f"no Ray node can hold {what} ({asked} on one node); the largest nodes "
                    f"have {_largest(nodes, group)}: lower the --ray-* amounts or add a larger "
                    f"node")
    return None


def _largest(nodes: Sequence[Mapping[str, float]], group: Mapping[str, float]) -> str:
    return "; ".join(", ".join(f"{n.get(k, 0.0):g} {k}" for k in group if group[k])
                     for n in sorted(nodes, key=lambda n: -n.get("CPU", 0.0))[:2])


def check_resources(what: str, resources: Mapping[str, float]) -> None:
    for name, amount in resources.items():
        if not isinstance(name, str) or not _RESOURCE.fullmatch(name):
            raise RaySpecError(f"{what}: bad resource name {name!r}")
        if name in ("CPU", "GPU", "memory", "object_store_memory"):
            raise RaySpecError(f"{what}: {name} is set by its own flag, not as a custom resource")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
            raise RaySpecError(f"{what}: {name} must be a number > 0, got {amount!r}")


def parse_resources(what: str, text: str | None) -> dict[str, float]:
    """A JSON object of custom resources (`{"worker_node": 0.1}`); errors name the flag."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise RaySpecError(f"{what}: not JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise RaySpecError(f"{what}: expected a JSON object of resource: amount, got {text!r}")
    check_resources(what, value)
    return {k: float(v) for k, v in value.items()}


def prefix(cluster_id: str) -> str:
    return f"pdserve-{cluster_id}-"


def full_name(cluster_id: str, member: str) -> str:
    """The Ray name of a member's actor (and of a worker's placement group)."""
    return prefix(cluster_id) + member


def member_of(cluster_id: str, name: str) -> str | None:
    """The member a Ray actor or placement group name stands for in this cluster, else None
    (another cluster's, even one whose name starts with this one's)."""
    p = prefix(cluster_id)
    if not name.startswith(p):
        return None
    member = name[len(p):]
    return member if _MEMBER.fullmatch(member) else None


def kind_of(member: str) -> str:
    if member.startswith("kvnode-"):
        return "node"
    if member.startswith(("prefill-", "decode-")):
        return "worker"
    return member


def store_member(ray_node_id: str) -> str:
    return f"kvnode-{ray_node_id[:12]}"


def store_node_id(cluster_id: str, ray_node_id: str) -> str:
    """The store's id of the storage node on a Ray node (in its segment files' names)."""
    return f"{cluster_id}-{ray_node_id[:12]}"


def tls_root(base_dir: str, cluster_id: str) -> str:
    """Where the cluster's members keep their TLS folders on a Ray node."""
    return os.path.join(base_dir, cluster_id, "tls")


def member_tls_dir(base_dir: str, cluster_id: str, member: str) -> str:
    """The member's TLS folder on its Ray node: ca.crt and its own kind's certificate and key,
    written there by its actor; nothing of another kind's (a worker's node holds no master
    key)."""
    return os.path.join(tls_root(base_dir, cluster_id), member)


def tls_args(spec: RaySpec, member: str) -> list[str]:
    """The internal-TLS flags of the member's process."""
    if spec.cluster.insecure_internal:
        return ["--insecure-internal"]
    return ["--tls-dir", member_tls_dir(spec.base_dir, spec.cluster_id, member)]


def probe_peer(member: str) -> str | None:
    """The kind whose certificate answers the member's health checks (the router's: on its
    control listener); None for a storage node, which prints a ready line instead."""
    kind = kind_of(member)
    return None if kind == "node" else kind


def cluster_marker(cluster_id: str) -> list[str]:
    """Python options that name the cluster in every process's command line (`-X` options are
    free-form; Python keeps them in sys._xoptions): how a sweep recognises its processes."""
    return ["-X", f"pdserve_cluster={cluster_id}"]


# The command lines, as `pdserve <kind> ...` arguments (the actor runs them with its Python),
# each from its process's config as the local launcher writes it (`launcher/commands.py`).

def master_args(spec: RaySpec, address: str, journal_dir: str) -> list[str]:
    cfg = MasterConfig(address=address, journal_dir=journal_dir, cluster_id=spec.cluster_id)
    return as_cli(command(cfg, tls_args(spec, "master")))


def node_args(spec: RaySpec, ray_node_id: str, ip: str, master: str) -> list[str]:
    # The host id is the Ray node: workers on it use shared memory, the others TCP (two Ray
    # nodes are two hosts, or two pods that do not share /dev/shm).
    cfg = NodeConfig(node_id=store_node_id(spec.cluster_id, ray_node_id), host_id=ray_node_id,
                     data_address=f"{ip}:0", dram_bytes=spec.store_dram_bytes,
                     masters=(master,), cluster_id=spec.cluster_id)
    return as_cli(command(cfg, tls_args(spec, store_member(ray_node_id))))


def worker_args(spec: RaySpec, member: str, role: str, address: str, ray_node_id: str,
                store: str, metrics_port: int) -> list[str]:
    """`store`: the master whose membership table the worker joins (its heartbeat teaches
    every router, a restarted one too)."""
    cfg = worker_config(spec.cluster, role, address, store, metrics_port,
                        spec.worker_threads(), advertise_address=address, host_id=ray_node_id)
    return as_cli(command(cfg, tls_args(spec, member)))


def router_args(spec: RaySpec, address: str, http: str | None, control: str,
                store: str) -> list[str]:
    """Pools start empty: the router follows the cluster's membership on the store master,
    where the workers join with their current role, so a restarted router learns the roles
    as they are now, never as they were at start.
    `address` and `http` serve the clients; `control` (TLS, each call authenticated) the
    workers and the controller. Files of the client ports' TLS must exist on its node."""
    cfg = router_config(spec.cluster, address, control, store, http)
    return as_cli(command(cfg, tls_args(spec, "router")))


def controller_args(spec: RaySpec, address: str, router_control: str, store: str,
                    audit_log: str, metrics_port: int) -> list[str]:
    cfg = controller_config(spec.cluster, address, router_control, store, audit_log,
                            metrics_port)
    return as_cli(command(cfg, tls_args(spec, "controller")))


# What a cluster is expected to hold, from its placement groups (they outlive a dead actor).

@dataclass(frozen=True)
class GroupInfo:
    name: str  # the placement group's Ray name
    state: str  # Ray's: PENDING, CREATED, REMOVED, RESCHEDULING
    bundle_nodes: tuple[str, ...]  # the Ray node id of each bundle ("" while unplaced)


def expected_members(cluster_id: str, groups: Sequence[GroupInfo]) -> list[str]:
    """Members the cluster's live placement groups stand for: the control group's processes,
    each worker, and one storage node per Ray node hosting a worker; sorted by stop order."""
    out: set[str] = set()
    for g in groups:
        member = member_of(cluster_id, g.name)
        if member is None or g.state == "REMOVED":
            continue
        if member == CONTROL_PG:
            out.update(CONTROL_MEMBERS[:len(g.bundle_nodes)])
        else:
            out.add(member)
            out.update(store_member(n) for n in g.bundle_nodes if n)
    return sorted(out, key=lambda m: (STOP_ORDER.index(kind_of(m)), m))


STATUS_COLUMNS = ("member", "kind", "state", "health", "pid", "restarts", "address", "ray node")


def status_rows(members: Sequence[str], live: Mapping[str, Mapping]) -> list[tuple[str, ...]]:
    """One row per member, expected or live: an expected member without a live actor is
    `actor dead`; a live one shows its process's state (running, restarting, exited, gave up)
    and health."""
    names = list(members) + sorted(m for m in live if m not in members)
    rows = []
    for m in names:
        st = live.get(m)
        if st is None:
            rows.append((m, kind_of(m), "actor dead", "-", "-", "-", "-", "-"))
            continue
        state = st.get("state", "?")
        if st.get("exit_code") is not None and state != "running":
            state += f" (exit {st['exit_code']})"
        rows.append((m, kind_of(m), state, st.get("health") or "-", str(st.get("pid") or "-"),
                     str(st.get("restarts", 0)),
                     st.get("address") or "-", (st.get("node_id") or "")[:12] or "-"))
    return rows


def ready_line(router: str, http: str | None, controller: str | None, cluster_id: str,
               control: str | None = None) -> str:
    """The line `pdserve serve` prints once the cluster serves (the local launcher's form)."""
    notes = "".join(f" {k}={v}" for k, v in (("http", http), ("controller", controller),
                                             ("control", control), ("cluster", cluster_id),
                                             ("backend", "ray")) if v)
    return f"pdserve ready on {router}{notes}"
