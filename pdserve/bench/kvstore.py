"""`pdserve bench kvstore`: the distributed KV store's bandwidth, batch gets and trace hit rate.

Owns one benchmark run, all on this machine, every figure beside its baseline from the same run:
1. put/get GB/s of objects of `--sizes` MiB between this process (client) and a storage node
   subprocess (plus a master subprocess): `DistStoreClient` end to end over shared memory (client
   host_id == node host_id), TCP and UCX (a different host_id; UCX where `ucxx` is installed and
   internal TLS is off, last and against a node of its own, whose UCX progress spins a core
   once a client connects; with no RDMA on these machines UCX carries its bytes over TCP), the
   raw transports alone (`pdserve.kvstore.transport.measure`), a memoryview memcpy and the object
   checksum of the same bytes, a private `redis-server` through redis-py SET/GET, and Mooncake
   Store put_from/get_into where it is installed (`kvstore_mooncake`, imported only then;
   otherwise the document says why not);
2. internal TLS (`--internal-tls on|off|both`, default both): the store's processes run with
   mutual TLS (`--tls-dir`), or with `--insecure-internal`, or both at once as two stores,
   whose TCP rows (raw transport and end to end) are then timed in interleaved rounds and
   reported as TLS / plaintext ratios with their spread (`kvstore_tls`), beside `openssl speed`
   of the cipher (the machine's crypto ceiling) and, where this process is root, the same rounds
   to a node behind a veth pair shaped to a NIC's rate (`--link-rate`, `kvstore_link`); the rows
   measured once (shared memory, batch gets) run with TLS whenever it is measured;
3. a batch get of 1,000 objects of 64 KiB: objects/s through both clients, redis MGET and a
   pipeline of GETs, Mooncake batch_get_into;
4. the store master's prefix-cache hit rate replaying a real trace (`kvstore_trace`) at a few
   capacities, beside the ideal (unbounded) cache and an exact LRU of the same capacity.
Convention: GB/s = 1e9 bytes/s, an object of N bytes moved once counts N bytes (memcpy too, not
STREAM's 2N); best of `repeats`. The aims (shm get >= 0.5x memcpy; TCP get >= Mooncake get_into;
TCP with internal TLS >= 0.9x without) are reported, never asserted. Progress goes to stderr;
`--json` prints one document on stdout.

Trace (read in place, never copied): `mooncake_conversation_trace.jsonl` from the Mooncake
(FAST '25) release traces, conversation workload, Apache-2.0; 12,031 requests over about one
hour; `timestamp` (ms from start), `input_length`, `output_length`, `hash_ids` (one id per
512-token prefix block; equal ids = shared prefix).
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

import numpy as np

from pdserve.core.errors import ConfigError as BenchConfigError  # bad setting: names it
from pdserve.bench.common import number_list
from pdserve.output import emit
from pdserve.bench import kvstore_measure as m
from pdserve.bench.kvstore_link import RATE, rate_gbps
from pdserve.bench.kvstore_procs import ProcessStartError, RedisServer, redis_server_path
from pdserve.bench.kvstore_stores import (  # noqa: F401 - REMOTE_SUFFIX: simtools.calibrate's
    REMOTE_SUFFIX, measure_link, measure_ucx, start_stores, suffix, tcp_paths,
)
from pdserve.bench.kvstore_summary import summarize
from pdserve.bench.kvstore_tls import MODES, OFF, ON, BenchTls, negotiated, openssl_speed, \
    tcp_rounds, warm
from pdserve.bench.kvstore_trace import (
    FULL_BLOCK_BYTES, TraceError, default_trace_path, ideal_hits, load_trace, replay_with_lru,
)

MiB = 1 << 20


@dataclass(frozen=True)
class KVStoreBenchSettings:
    """What one run measures; validated here so a bad CLI value fails before any process starts."""

    sizes_mib: tuple[int, ...] = (4, 16, 64, 256)
    repeats: int = 5
    batch_objects: int = 1000
    batch_object_bytes: int = 64 << 10
    trace_path: str = ""  # "" -> ../shared/traces/mooncake_conversation_trace.jsonl
    trace_requests: int | None = None  # None: the whole trace
    trace_scale: float = 1 / 64
    capacity_blocks: tuple[int, ...] = (1000, 4000, 16000)
    redis: bool = True
    mooncake: bool = True
    internal_tls: str = "both"  # on, off, or both (TCP rows interleaved with and without)
    link_rate: str = RATE  # the shaped link's rate; "" skips it
    link_sizes_mib: tuple[int, ...] = (4, 64)
    link_rounds: int = 10  # the token bucket makes single transfers vary: more rounds than repeats

    def __post_init__(self) -> None:
        if self.internal_tls not in MODES:
            raise BenchConfigError(f"--internal-tls must be one of {', '.join(MODES)}, got "
                                   f"{self.internal_tls!r}")
        if self.link_rate:
            try:
                rate_gbps(self.link_rate)
            except ValueError as e:
                raise BenchConfigError(str(e)) from None
        if not self.link_sizes_mib or any(s <= 0 or s > 1024 for s in self.link_sizes_mib):
            raise BenchConfigError(f"--link-sizes must be in 1..1024 MiB, got "
                                   f"{self.link_sizes_mib}")
        if not self.sizes_mib or any(s <= 0 or s > 1024 for s in self.sizes_mib):
            raise BenchConfigError(f"sizes_mib must be in 1..1024, got {self.sizes_mib}")
        if not self.capacity_blocks or any(c <= 0 for c in self.capacity_blocks):
            raise BenchConfigError(f"capacity_blocks must be positive, got {self.capacity_blocks}")
        for name in ("repeats", "batch_objects", "batch_object_bytes", "link_rounds"):
            if getattr(self, name) <= 0:
                raise BenchConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.trace_requests is not None and self.trace_requests <= 0:
            raise BenchConfigError(f"trace_requests must be positive, got {self.trace_requests}")
        if not 0 < self.trace_scale <= 1:
            raise BenchConfigError(f"trace_scale must be in (0, 1], got {self.trace_scale}")

    @property
    def sizes_bytes(self) -> list[int]:
        return [s * MiB for s in self.sizes_mib]

    def node_segment_bytes(self) -> int:
        """Room for the raw-transport reservation, the object in flight and one removed object
        still under its read lease (4x the largest), or twice the batch (its objects must stay
        below the eviction watermark), plus slack."""
        return max(4 * max(self.sizes_bytes), 2 * self.batch_objects * self.batch_object_bytes) \
            + 16 * MiB

    def mooncake_segment_bytes(self) -> int:
        """Room for the object in flight and two read ones whose 1 s lease has not ended."""
        return max(4 * max(self.sizes_bytes), 2 * self.batch_objects * self.batch_object_bytes) \
            + 16 * MiB


DEFAULTS = KVStoreBenchSettings()
QUICK = KVStoreBenchSettings(sizes_mib=(1, 4), repeats=2, batch_objects=100, trace_requests=500,
                             link_sizes_mib=(4,), link_rounds=2)


class _Progress:
    """A rich progress bar on stderr (or nothing); one task per phase."""

    def __init__(self, enabled: bool):
        self._stack = ExitStack()
        self._bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
            )

            self._bar = self._stack.enter_context(Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), console=Console(stderr=True)))

    def task(self, description: str, total: int) -> Any:
        return self._bar.add_task(description, total=total) if self._bar else None

    def step(self, task: Any, description: str | None = None, advance: int = 1) -> None:
        if self._bar is not None:
            kwargs = {"description": description} if description else {}
            self._bar.update(task, advance=advance, **kwargs)

    def close(self) -> None:
        self._stack.close()


def _measure_processes(s: KVStoreBenchSettings, bar: _Progress, raw: dict[str, Any],
                       bt: BenchTls) -> None:
    """Everything but UCX that needs the store, redis and Mooncake processes: bandwidth rows
    (TCP with and without internal TLS, in interleaved rounds) and batch gets."""
    from pdserve.kvstore.dist_client import DistStoreClient
    from pdserve.kvstore.transport.shm import ShmTransport
    from pdserve.kvstore.transport.ucx import ucx_available

    ucx = ucx_available() and OFF in bt.modes  # UCX has no TLS: the plaintext pass only
    raw["ucx"] = {"available": ucx, **({} if ucx else {"reason": (
        "ucxx is not installed (pip install ucxx-cu12) or PDSERVE_UCX=0"
        if not ucx_available() else "UCX carries KV bytes in plaintext: measured only "
        "with internal TLS off (--internal-tls off or both)")})}
    with ExitStack() as stack:
        stores = start_stores(s, bt, stack)
        main = stores[bt.main]
        shm_client = stack.enter_context(DistStoreClient(main.master_address, main.host_id))
        paths = tcp_paths(stores, bt, stack, max(s.sizes_bytes))
        raw["node"] = {"host_id": main.host_id, "segment_bytes": s.node_segment_bytes(),
                       "master_lease_s": main.lease_s}
        raw["internal_tls"]["processes"] = {mode: st.processes() for mode, st in stores.items()}
        if ON in stores:
            raw["internal_tls"]["negotiated"] = negotiated(
                stores[ON].node_info["data_address"], bt.settings[ON])
        rds = None
        if raw["redis"]["available"]:
            try:
                rds = stack.enter_context(RedisServer()).client()
                info = rds.info("server")
                raw["redis"]["server_version"] = info.get("redis_version")
            except ProcessStartError as e:
                raw["redis"] = {"available": False, "reason": str(e)}
        mc = None
        if raw["mooncake"]["available"]:
            try:
                from pdserve.bench.kvstore_mooncake import LEASE_MS, MooncakeCluster

                raw["mooncake"]["lease_ms"] = LEASE_MS
                mc = MooncakeCluster(s.mooncake_segment_bytes())
                stack.callback(mc.stop)
                mc.start()
            except Exception as e:  # any failure is the reason, word for word
                raw["mooncake"] = {**raw["mooncake"], "available": False,
                                   "reason": f"starting: {type(e).__name__}: {e}"}
                mc = None
        shm_t = stack.enter_context(ShmTransport())
        extent = paths[bt.main].extent
        warm(paths)

        task = bar.task("bandwidth", len(s.sizes_bytes))
        for size in s.sizes_bytes:
            bar.step(task, f"bandwidth {size // MiB} MiB", advance=0)
            src, dst = m.payload(size), np.empty(size, dtype=np.uint8)
            row: dict[str, Any] = {"size_bytes": size, "memcpy_s": m.memcpy_s(src, dst, s.repeats),
                                   "crc32_s": m.crc32_s(src, s.repeats)}
            row["raw_shm"] = m.raw_transport(shm_t, extent, size, s.repeats)
            row["pdserve_shm"] = m.client_rounds(shm_client, src, dst, s.repeats, "shm")
            for mode, got in tcp_rounds(paths, src, dst, s.repeats, "tcp").items():
                row["raw_tcp" + suffix(mode)] = got["raw"]
                row["pdserve_tcp" + suffix(mode)] = got["pdserve"]
            if rds is not None:
                row["redis"] = m.redis_rounds(rds, src, s.repeats)
            if mc is not None:
                try:
                    row["mooncake"] = mc.rounds(src, dst, s.repeats)
                except Exception as e:
                    why = f"put/get of {size} bytes: {type(e).__name__}: {e}"
                    raw["mooncake"] = {**raw["mooncake"], "available": False, "reason": why}
                    mc = None
            raw["bandwidth"].append(row)
            bar.step(task)

        n, size = s.batch_objects, s.batch_object_bytes
        task = bar.task(f"batch get {n} x {size // 1024} KiB", 3)
        data = m.payload(n * size, seed=1)
        keys = {mode: m.batch_store(shm_client if mode == bt.main else paths[mode].client,
                                    data, n, size) for mode in bt.modes}
        batch = raw["batch"]
        batch["pdserve_shm"] = m.batch_get_client(shm_client, keys[bt.main], data, size,
                                                  s.repeats)
        bar.step(task)
        for mode in bt.modes:
            batch["pdserve_tcp" + suffix(mode)] = m.batch_get_client(
                paths[mode].client, keys[mode], data, size, s.repeats)
        bar.step(task)
        if rds is not None:
            got = m.batch_redis(rds, data, n, size, s.repeats)
            batch["redis_mget"], batch["redis_pipeline"] = got["mget_s"], got["pipeline_s"]
        bar.step(task)
        if mc is not None:
            try:
                batch["mooncake"] = mc.batch_get(data, n, size, s.repeats)
            except Exception as e:
                raw["mooncake"] = {**raw["mooncake"], "available": False,
                                   "reason": f"batch get: {type(e).__name__}: {e}"}
        bar.step(task)
    if not raw["mooncake"]["available"]:  # a failure part way: no partial Mooncake figures
        for row in raw["bandwidth"]:
            row.pop("mooncake", None)
        raw["batch"].pop("mooncake", None)


PARALLEL_REPLAY_MIN_REQUESTS = 2000  # below this, starting processes costs more than it saves


def _replay_trace(s: KVStoreBenchSettings, requests: list, bar: _Progress) -> dict[str, Any]:
    """Each capacity replayed by its own MasterCore. A long trace replays its capacities in
    parallel processes (spawned: this process has used gRPC), one per core at most: nothing
    is timed by then, and the hit counts do not depend on it."""
    object_bytes = max(1, round(s.trace_scale * FULL_BLOCK_BYTES))
    hits, total = ideal_hits(requests)
    out: dict[str, Any] = {"ideal_hit_blocks": hits, "total_blocks": total,
                           "unique_blocks": len({k for _, keys in requests for k in keys}),
                           "object_bytes": object_bytes, "capacities": []}
    caps = list(s.capacity_blocks)
    workers = min(len(caps), os.cpu_count() or 1)
    if workers < 2 or len(requests) < PARALLEL_REPLAY_MIN_REQUESTS:
        task = bar.task("trace replay", len(caps) * len(requests))
        for cap in caps:
            bar.step(task, f"trace replay, {cap} blocks", advance=0)
            out["capacities"].append(replay_with_lru(requests, cap, object_bytes,
                                                     on_request=lambda: bar.step(task)))
        return out
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    task = bar.task(f"trace replay, {len(caps)} capacities in {workers} processes", len(caps))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(replay_with_lru, requests, cap, object_bytes) for cap in caps]
        for f in futures:
            out["capacities"].append(f.result())
            bar.step(task)
    return out


def _machine() -> dict[str, Any]:
    import redis

    try:
        import hiredis  # noqa: F401
        parser = "hiredis"
    except ImportError:
        parser = "python"
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(),
            "processor": platform.processor() or None, "python": platform.python_version(),
            "numpy": np.__version__, "redis_py": redis.__version__, "redis_py_parser": parser,
            "hostname": socket.gethostname(),
            "loadavg_1m_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def run_kvstore_bench(s: KVStoreBenchSettings = DEFAULTS, progress: bool = True) -> dict[str, Any]:
    """Measure everything once and return the result document (see `kvstore_summary`)."""
    started = time.perf_counter()
    trace_path = s.trace_path or default_trace_path()
    requests = load_trace(trace_path, s.trace_requests)  # a bad trace fails before any process
    machine = _machine()
    raw: dict[str, Any] = {"bandwidth": [], "batch": {}}
    if not s.redis:
        raw["redis"] = {"available": False, "reason": "disabled with --no-redis"}
    elif redis_server_path() is None:
        raw["redis"] = {"available": False, "reason": "redis-server not found on PATH"}
    else:
        raw["redis"] = {"available": True, "reason": None}
    if not s.mooncake:
        raw["mooncake"] = {"available": False, "reason": "disabled with --no-mooncake"}
    else:
        from pdserve.bench.kvstore_mooncake import probe, version

        ok, why = probe()
        raw["mooncake"] = {"available": ok, "reason": why, "version": version(),
                           "protocol": "tcp", "segment_bytes": s.mooncake_segment_bytes()}
    bar = _Progress(progress)
    try:
        with BenchTls(s.internal_tls) as bt:
            raw["internal_tls"] = {**bt.describe(), "rounds": s.repeats,
                                   "crypto_ceiling": openssl_speed()}
            _measure_processes(s, bar, raw, bt)
            measure_ucx(s, bar, raw, bt)
            raw["link"] = measure_link(s, bar, bt)
        raw["trace"] = _replay_trace(s, requests, bar)
    finally:
        bar.close()
    raw["trace"].update(path=trace_path, requests=len(requests))
    machine["loadavg_1m_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return summarize(s, machine, raw, wall_s=time.perf_counter() - started)


# ---- CLI ----------------------------------------------------------------------------------------
def _scale(text: str) -> float:
    try:
        return float(Fraction(text.strip()))
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"--trace-scale wants a number like 1/64 or 0.015625, "
                                         f"got {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = DEFAULTS
    parser.add_argument("--sizes", type=number_list("--sizes", example="4,16,64"),
                        default=None,
                        help="object sizes in MiB, comma-separated (default 4,16,64,256)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed runs per figure, best kept (default {d.repeats})")
    parser.add_argument("--batch-objects", type=int, default=None,
                        help=f"objects in the batch get (default {d.batch_objects})")
    parser.add_argument("--batch-object-bytes", type=int, default=None,
                        help=f"bytes per batch object (default {d.batch_object_bytes})")
    parser.add_argument("--trace", metavar="PATH", default=None,
                        help="Mooncake-format JSONL trace (default "
                             "../shared/traces/mooncake_conversation_trace.jsonl)")
    parser.add_argument("--trace-requests", type=int, default=None,
                        help="replay only the first N requests (default: all; --quick: 500)")
    parser.add_argument("--trace-scale", type=_scale, default=None,
                        help="object bytes = this x a 64 MiB KV block (default 1/64); bytes only")
    parser.add_argument("--capacity-blocks",
                        type=number_list("--capacity-blocks", example="4,16,64"), default=None,
                        help="store capacities in blocks, comma-separated "
                             "(default 1000,4000,16000)")
    parser.add_argument("--no-redis", action="store_true", help="skip the redis-server baseline")
    parser.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake baseline")
    parser.add_argument("--internal-tls", default=None, metavar="on|off|both",
                        help="the store's internal TLS: on (mutual TLS, as `pdserve serve`), "
                             "off (--insecure-internal; the only setting UCX runs in), or both "
                             "(default): the TCP rows measured with and without in alternating "
                             "rounds, and their ratio")
    parser.add_argument("--link-rate", default=None, metavar="RATE|off",
                        help=f"also measure TCP with and without TLS to a node behind a veth "
                             f"pair shaped to this rate (default {d.link_rate}; needs root and "
                             f"iproute2; off: skip)")
    parser.add_argument("--link-sizes", type=number_list("--link-sizes", example="4,64"),
                        default=None, help="object sizes in MiB over the shaped link "
                                           "(default 4,64)")
    parser.add_argument("--link-rounds", type=int, default=None,
                        help=f"interleaved rounds over the shaped link (default "
                             f"{d.link_rounds}; --quick: 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.add_argument("--out", metavar="DIR",
                        help="also write DIR/kvstore.json, DIR/kvstore_bandwidth.png and "
                             "DIR/kvstore_trace.png")
    parser.add_argument("--quick", action="store_true",
                        help="tiny run for tests: 1,4 MiB; 2 repeats; 100 batch objects; 500 "
                             "trace requests (flags given explicitly still win)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def settings_from_args(args: argparse.Namespace) -> KVStoreBenchSettings:
    base = QUICK if args.quick else DEFAULTS
    given = {"sizes_mib": args.sizes, "repeats": args.repeats, "batch_objects": args.batch_objects,
             "batch_object_bytes": args.batch_object_bytes, "trace_path": args.trace,
             "trace_requests": args.trace_requests, "trace_scale": args.trace_scale,
             "capacity_blocks": args.capacity_blocks, "internal_tls": args.internal_tls,
             "link_rate": None if args.link_rate is None else
             ("" if args.link_rate == "off" else args.link_rate),
             "link_sizes_mib": args.link_sizes, "link_rounds": args.link_rounds}
    return replace(base, redis=not args.no_redis, mooncake=not args.no_mooncake,
                   **{k: v for k, v in given.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.kvstore_report import print_tables, write_outputs

    try:
        result = run_kvstore_bench(settings_from_args(args), progress=not args.no_progress)
    except (BenchConfigError, TraceError) as e:
        print(f"pdserve bench kvstore: {e}", file=sys.stderr)
        return 2
    except ProcessStartError as e:
        print(f"pdserve bench kvstore: {e}", file=sys.stderr)
        return 1
    return emit(result, json_out=args.json, out_dir=args.out, write_outputs=write_outputs,
                print_tables=print_tables)


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(
        prog="pdserve bench kvstore", description=__doc__.split("\n", 1)[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
