"""Mooncake Store as a baseline of `pdserve bench kvstore`, used only where it is installed.

Owns finding out whether Mooncake can run here (`probe`: the `mooncake.store` module and its
`mooncake_master` binary, from the optional group `bench-mooncake`, i.e. PyPI
`mooncake-transfer-engine-non-cuda`, plus Debian `libibverbs1`), a private Mooncake cluster like
pdserve's (`mooncake_master` with its built-in HTTP metadata server; one storage process that
mounts a segment, started as `python -m pdserve.bench.kvstore_mooncake`; this process as a client
contributing no memory), and its timing loops: put_from / get_into of registered buffers and
batch_get_into of small objects. Protocol "tcp" (the transfer engine's TCP transport; the
storage process is another process, so bytes cross a socket as with pdserve's TCP path).
Each process gets its own `local_hostname` host:port and MC_LEGACY_RPC_PORT_BINDING=1.
Must not be imported by `kvstore.py` unless `probe()` said yes; must not fake a figure: any
failure is raised as MooncakeError with Mooncake's own return code or message.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

from pdserve.bench.kvstore_measure import MeasureError, times_s
from pdserve.bench.kvstore_procs import START_TIMEOUT_S, Child, free_port, repo_env
from pdserve.lifecycle import StopSignals

# Mooncake reads both when its library loads; its INFO lines would bury the progress bar.
ENV = {"MC_LEGACY_RPC_PORT_BINDING": "1", "MC_LOG_LEVEL": "ERROR"}
# Read lease: a get_into fails with LEASE_EXPIRED (-707) if its lease ends before the bytes
# arrive, so it must outlast the largest transfer; removes wait for it (see _Reaper).
LEASE_MS = 1000
RC_HAS_LEASE = -706
DIST = "mooncake-transfer-engine-non-cuda"


class MooncakeError(RuntimeError):
    """Mooncake could not be started or returned an error code; the message has it."""


def _master_binary() -> str | None:
    found = shutil.which("mooncake_master")
    if found:
        return found
    try:
        import mooncake
    except ImportError:
        return None
    here = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    return here if os.access(here, os.X_OK) else None


def probe() -> tuple[bool, str | None]:
    """(True, None) if Mooncake Store can be tried here, else (False, the exact reason)."""
    for k, v in ENV.items():
        os.environ.setdefault(k, v)  # read by the library when it loads
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as e:  # ImportError, or an OSError from a missing libibverbs
        return False, (f"from mooncake.store import MooncakeDistributedStore: "
                       f"{type(e).__name__}: {e}")
    if _master_binary() is None:
        return False, "the mooncake_master binary is not on PATH nor in the mooncake package"
    return True, None


def version() -> str | None:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as v
    try:
        return v(DIST)
    except PackageNotFoundError:
        return None


def _setup(store, local: str, metadata: str, master: str, segment_bytes: int) -> None:
    rc = store.setup(local, metadata, segment_bytes, 16 << 20, "tcp", "", master)
    if rc != 0:
        raise MooncakeError(f"MooncakeDistributedStore.setup({local!r}, {metadata!r}, "
                            f"segment {segment_bytes}) returned {rc}")


class MooncakeCluster:
    """mooncake_master + one storage process + an in-process client (no memory of its own)."""

    def __init__(self, segment_bytes: int):
        self.segment_bytes = segment_bytes
        self.master_address = ""
        self.metadata_url = ""
        self._children: list[Child] = []
        self.store: Any = None
        self._pending: list[tuple[str, int]] = []  # (key, bytes) read, to remove

    def start(self) -> MooncakeCluster:
        from mooncake.store import MooncakeDistributedStore

        env = {**repo_env(), **ENV}
        rpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
        self.master_address = f"127.0.0.1:{rpc_port}"
        self.metadata_url = f"http://127.0.0.1:{http_port}/metadata"
        master = Child("mooncake_master", [
            _master_binary() or "mooncake_master", f"--rpc_port={rpc_port}",
            "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http_port}", f"--metrics_port={metrics_port}",
            f"--default_kv_lease_ttl={LEASE_MS}"], env=env)
        self._children.append(master)
        self._wait_port(master, rpc_port)
        self._wait_port(master, http_port)
        node = Child("mooncake storage process", [
            sys.executable, "-m", "pdserve.bench.kvstore_mooncake", "--master",
            self.master_address, "--metadata", self.metadata_url, "--segment-bytes",
            str(self.segment_bytes)], stdout=-1, env=env)
        self._children.append(node)
        line = node.proc.stdout.readline() if node.proc.stdout else b""
        if not line:
            raise node.failed("printed no ready line")
        self.store = MooncakeDistributedStore()
        _setup(self.store, f"127.0.0.1:{free_port()}", self.metadata_url, self.master_address, 0)
        return self

    @staticmethod
    def _wait_port(child: Child, port: int) -> None:
        import socket

        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                if child.proc.poll() is not None or time.monotonic() > deadline:
                    raise child.failed(f"did not listen on port {port}") from None
                time.sleep(0.05)

    def _try_remove(self, key: str) -> bool:
        """True once `key` is gone; False while a read lease still holds it."""
        rc = self.store.remove(key)
        if rc == RC_HAS_LEASE:
            return False
        if rc != 0 and self.store.is_exist(key) == 1:
            raise MooncakeError(f"remove({key!r}) returned {rc}")
        return True

    def _make_room(self, size: int) -> None:
        """Removes what leases allow; waits for the oldest lease while the objects left plus a
        new one of `size` bytes would pass 80% of the segment (Mooncake evicts from 90%)."""
        self._pending = [(k, n) for k, n in self._pending if not self._try_remove(k)]
        deadline = time.monotonic() + 5 * LEASE_MS / 1000
        while self._pending and sum(n for _, n in self._pending) + size > 0.8 * self.segment_bytes:
            if time.monotonic() > deadline:
                raise MooncakeError(f"{len(self._pending)} removed objects stayed leased")
            time.sleep(0.02)
            if self._try_remove(self._pending[0][0]):
                self._pending.pop(0)

    def rounds(self, src: np.ndarray, dst: np.ndarray, repeats: int) -> dict[str, list[float]]:
        """put_from (fresh key) and get_into per round, both from registered buffers."""
        s = self.store
        for buf in (src, dst):
            if (rc := s.register_buffer(buf.ctypes.data, buf.nbytes)) != 0:
                raise MooncakeError(f"register_buffer of {buf.nbytes} bytes returned {rc}")
        put, get = [], []
        try:
            for r in range(repeats):
                key = f"bw-mc-{src.size}-{r}-{time.monotonic_ns()}"
                self._make_room(src.nbytes)
                t0 = time.perf_counter()
                rc = s.put_from(key, src.ctypes.data, src.nbytes)
                put.append(time.perf_counter() - t0)
                if rc != 0:
                    raise MooncakeError(f"put_from({key!r}, {src.nbytes} bytes) returned {rc}")
                dst[:16] = 0
                t0 = time.perf_counter()
                n = s.get_into(key, dst.ctypes.data, dst.nbytes)
                get.append(time.perf_counter() - t0)
                if n != src.nbytes:
                    raise MooncakeError(f"get_into({key!r}, {dst.nbytes} bytes) returned {n}")
                if r == 0 and not np.array_equal(src, dst):
                    raise MeasureError("Mooncake get_into returned other bytes")
                self._pending.append((key, src.nbytes))  # removed once its lease ends
        finally:
            s.unregister_buffer(src.ctypes.data)
            s.unregister_buffer(dst.ctypes.data)
        return {"put_s": put, "get_s": get}

    def batch_get(self, data: np.ndarray, count: int, size: int, repeats: int) -> list[float]:
        """batch_put_from of `count` objects, then timed batch_get_into of all of them."""
        s = self.store
        self._make_room(data.nbytes)
        out = np.zeros_like(data)
        for buf in (data, out):
            if (rc := s.register_buffer(buf.ctypes.data, buf.nbytes)) != 0:
                raise MooncakeError(f"register_buffer of {buf.nbytes} bytes returned {rc}")
        keys = [f"batch-mc-{time.monotonic_ns()}-{i}" for i in range(count)]
        try:
            rcs = s.batch_put_from(keys, [data.ctypes.data + i * size for i in range(count)],
                                   [size] * count)
            if any(rc != 0 for rc in rcs):
                raise MooncakeError(f"batch_put_from returned {sorted(set(rcs))}")
            ptrs = [out.ctypes.data + i * size for i in range(count)]
            got: list[list[int]] = [[]]

            def run() -> None:
                got[0] = s.batch_get_into(keys, ptrs, [size] * count)
            times = times_s(run, repeats)
            if any(n != size for n in got[0]):
                raise MooncakeError(f"batch_get_into returned {sorted(set(got[0]))}")
            if not np.array_equal(out, data):
                raise MeasureError("Mooncake batch_get_into returned other bytes")
        finally:
            s.unregister_buffer(data.ctypes.data)
            s.unregister_buffer(out.ctypes.data)
        for key in keys:
            s.remove(key)  # best effort: the cluster is stopped next anyway
        return times

    def stop(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
        for child in reversed(self._children):
            if child.proc.stdout:
                child.proc.stdout.close()
            child.stop()
        self._children = []


# ---- the storage process ------------------------------------------------------------------------
def _node_main(argv: list[str] | None = None) -> int:
    """Mounts a segment of --segment-bytes, prints one JSON ready line, serves until SIGTERM."""
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.kvstore_mooncake")
    p.add_argument("--master", required=True)
    p.add_argument("--metadata", required=True)
    p.add_argument("--segment-bytes", type=int, required=True)
    a = p.parse_args(argv)
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    from mooncake.store import MooncakeDistributedStore

    stop = threading.Event()
    StopSignals(stop, (signal.SIGTERM,))
    store = MooncakeDistributedStore()
    local = f"127.0.0.1:{free_port()}"
    try:
        _setup(store, local, a.metadata, a.master, a.segment_bytes)
    except MooncakeError as e:
        print(str(e), file=sys.stderr)
        return 1
    print(json.dumps({"event": "ready", "pid": os.getpid(), "local_hostname": local}), flush=True)
    while not stop.wait(0.5):
        pass
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(_node_main())
