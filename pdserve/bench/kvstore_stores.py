"""The TCP and UCX phases of `pdserve bench kvstore`: one store per internal-TLS setting, the
TCP paths to it, UCX alone, and the shaped link.

Owns which stores each phase starts (a master and a node per setting measured: `--tls-dir` or
`--insecure-internal`, `kvstore_procs`), the clients and transports made under each setting
(`kvstore_tls.BenchTls.using`), UCX measured last against a plaintext node of its own (once a
UCX client has connected, the node's UCX progress spins a core: measured 1.0 CPU s/s idle, 0.02
before, which would slow every figure beside it on a small machine), and the same TCP rounds to
a node behind a link shaped to a NIC's rate (`kvstore_link`). Must not compute figures
(`kvstore_summary`) or print.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import numpy as np

from pdserve.bench import kvstore_measure as m
from pdserve.bench.kvstore_link import LinkUnavailable, ShapedLink, why_unavailable
from pdserve.bench.kvstore_procs import PdserveStore
from pdserve.bench.kvstore_tls import OFF, ON, BenchTls, TcpPath, tcp_rounds, warm

MiB = 1 << 20
REMOTE_SUFFIX = "-bench-remote"  # a client host_id that differs from the node's: TCP


def start_stores(s: Any, bt: BenchTls, stack: ExitStack,
                 **where: Any) -> dict[str, PdserveStore]:
    """One store (master + node) per setting measured."""
    return {mode: stack.enter_context(PdserveStore(
        s.node_segment_bytes(), security=bt.settings[mode],
        name=f"store ({'TLS' if mode == ON else 'plaintext'})", **where))
        for mode in bt.modes}


def tcp_paths(stores: dict[str, PdserveStore], bt: BenchTls, stack: ExitStack,
              size: int) -> dict[str, TcpPath]:
    """Per setting: a raw TcpTransport with an extent reserved on its node, and a store client
    with another host id (so over TCP), each made under that setting; the node registered."""
    from pdserve.kvstore.dist_client import DistStoreClient
    from pdserve.kvstore.transport.tcp import TcpTransport

    paths = {}
    for mode, store in stores.items():
        with bt.using(mode) as security:
            client = stack.enter_context(DistStoreClient(
                store.master_address, store.host_id + REMOTE_SUFFIX, ucx=False))
            store.wait_registered(client)
            extent, release = m.reserve_extent(store.master_address, size, security)
            stack.callback(release)
            transport = stack.enter_context(TcpTransport(security=security))
        paths[mode] = TcpPath(transport, extent, client)
    return paths


def suffix(mode: str) -> str:
    return "_tls" if mode == ON else ""


def measure_ucx(s: Any, bar: Any, raw: dict[str, Any], bt: BenchTls) -> None:
    """UCX rows, last and alone: a plaintext store of its own whose node serves UCX. Once a UCX
    client has connected, the node's UCX progress spins a core (measured: 1.0 CPU s/s idle,
    0.02 before), which would slow every figure measured beside it on a small machine."""
    from pdserve.kvstore.dist_client import DistStoreClient

    if not raw["ucx"]["available"]:
        return
    with ExitStack() as stack, bt.using(OFF) as plaintext:
        store = stack.enter_context(PdserveStore(
            s.node_segment_bytes(), ucx=True, security=plaintext, name="store (UCX)"))
        client = stack.enter_context(DistStoreClient(
            store.master_address, store.host_id + REMOTE_SUFFIX, ucx=True))
        store.wait_registered(client)
        raw["ucx"]["processes"] = store.processes()
        task = bar.task("ucx", len(raw["bandwidth"]) + 1)
        for row in raw["bandwidth"]:
            size = row["size_bytes"]
            bar.step(task, f"ucx {size // MiB} MiB", advance=0)
            src, dst = m.payload(size), np.empty(size, dtype=np.uint8)
            row["pdserve_ucx"] = m.client_rounds(client, src, dst, s.repeats, "ucx")
            bar.step(task)
        n, size = s.batch_objects, s.batch_object_bytes
        data = m.payload(n * size, seed=1)
        keys = m.batch_store(client, data, n, size)
        raw["batch"]["pdserve_ucx"] = m.batch_get_client(client, keys, data, size, s.repeats)
        bar.step(task)


def measure_link(s: Any, bar: Any, bt: BenchTls) -> dict[str, Any]:
    """The TCP rounds again, to a node behind a link shaped to `s.link_rate` (kvstore_link)."""
    if not s.link_rate:
        return {"available": False, "reason": "disabled with --link-rate off"}
    why = why_unavailable()
    if why:
        return {"available": False, "reason": why, "rate": s.link_rate}
    sizes = [z * MiB for z in s.link_sizes_mib]
    out: dict[str, Any] = {"available": True, "reason": None, "rows": [],
                           "rounds": s.link_rounds}
    task = bar.task(f"link {s.link_rate}", len(sizes))
    try:
        with ExitStack() as stack:
            link = stack.enter_context(ShapedLink(s.link_rate))
            out.update(link.describe())
            stores = start_stores(s, bt, stack, host=link.host_ip, node_prefix=link.prefix,
                                  data_host=link.ns_ip)
            paths = tcp_paths(stores, bt, stack, max(sizes))
            out["processes"] = {mode: st.processes() for mode, st in stores.items()}
            warm(paths)
            for size in sizes:
                bar.step(task, f"link {s.link_rate}, {size // MiB} MiB", advance=0)
                src, dst = m.payload(size), np.empty(size, dtype=np.uint8)
                row: dict[str, Any] = {"size_bytes": size}
                for mode, got in tcp_rounds(paths, src, dst, s.link_rounds, "link").items():
                    row["raw_tcp" + suffix(mode)] = got["raw"]
                    row["pdserve_tcp" + suffix(mode)] = got["pdserve"]
                out["rows"].append(row)
                bar.step(task)
    except LinkUnavailable as e:
        return {"available": False, "reason": str(e), "rate": s.link_rate}
    return out
