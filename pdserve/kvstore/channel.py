"""How the store's clients reach a master: channels that reconnect fast, and the cluster id.

Owns the gRPC channel options of every store client (workers' store clients, storage nodes'
registration): a master that restarts is reached again within about a second, where gRPC's
default reconnect backoff grows to two minutes. Owns the cluster id's form and its wire
protocol: a client with a cluster id sends it as call metadata (`pdserve-cluster-id`) on every
master call; a master serving another cluster refuses with FAILED_PRECONDITION naming both ids
and marks the refusal with trailing metadata (`pdserve-cluster-mismatch`), so a client tells it
apart from any other refusal without parsing the message. An empty id on either side accepts
any. The rule itself (`cluster_mismatch`) is pure. Must not import `pdserve.engine`.
"""

from __future__ import annotations

import re

import grpc

from pdserve import rpc
from pdserve.core.errors import ConfigError
from pdserve.core.identity import MASTER

CLUSTER_ID_METADATA = "pdserve-cluster-id"
MISMATCH_METADATA = "pdserve-cluster-mismatch"
# A standby names the leader it knows in this trailing metadata when it refuses a call.
LEADER_METADATA = "pdserve-leader"
# Items in one batch call to the master (BatchPutStart, BatchPutCommit); clients split larger.
MAX_BATCH_ITEMS = 4096

_CLUSTER_ID = re.compile(r"[A-Za-z0-9._:-]{0,128}")

# Reconnect within a second of a master (or a restarted one) listening again.
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class ClusterMismatch(Exception):
    """A master refused this client: it serves another cluster. The message names both ids."""


def check_cluster_id(cluster_id: str, field: str = "cluster_id") -> str:
    """`cluster_id` if well formed (letters, digits, `._:-`, at most 128; empty: any cluster),
    else ConfigError naming `field`."""
    if not isinstance(cluster_id, str) or not _CLUSTER_ID.fullmatch(cluster_id):
        raise ConfigError(f"{field} must be up to 128 of [A-Za-z0-9._:-], got {cluster_id!r}")
    return cluster_id


def cluster_mismatch(caller_id: str, master_id: str) -> str | None:
    """Why a caller in cluster `caller_id` may not use a master of cluster `master_id`, or None
    when it may (equal ids, or either empty)."""
    if not caller_id or not master_id or caller_id == master_id:
        return None
    return (f"cluster id mismatch: the caller's cluster id is {caller_id!r}, the store "
            f"master's is {master_id!r}")


def call_metadata(cluster_id: str) -> tuple[tuple[str, str], ...]:
    """Metadata for every master call of a client in `cluster_id` (none when empty)."""
    return ((CLUSTER_ID_METADATA, cluster_id),) if cluster_id else ()


def _trailing(e: grpc.RpcError, key: str) -> str:
    try:
        pairs = e.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - an error raised before the call started has none
        return ""
    return next((v for k, v in pairs if k == key), "")


def is_cluster_mismatch(e: grpc.RpcError) -> bool:
    return (e.code() == grpc.StatusCode.FAILED_PRECONDITION
            and bool(_trailing(e, MISMATCH_METADATA)))


def leader_hint(e: grpc.RpcError) -> str:
    """The leader a standby named when it refused the call ("" if none)."""
    return _trailing(e, LEADER_METADATA)


def ask_the_named_leader_next(order: list[int], masters: list[str], e: grpc.RpcError) -> None:
    """When a standby's refusal `e` names a leader among `masters` that `order` (indexes into
    `masters`, still to ask) holds, move it to the front."""
    hint = leader_hint(e)
    if hint in masters and masters.index(hint) in order:
        order.remove(masters.index(hint))
        order.insert(0, masters.index(hint))


def make_store_channel(address: str) -> grpc.Channel:
    """A channel to a store master (mutual TLS unless internal TLS is off: `rpc.make_channel`)
    with pdserve's message limits and fast reconnection."""
    return rpc.make_channel(address, MASTER, options=_RECONNECT_OPTIONS)
