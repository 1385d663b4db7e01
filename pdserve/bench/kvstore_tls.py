"""Internal TLS in `pdserve bench kvstore`: the settings the stores run under, and what TLS costs.

Owns the bench's two settings (`on`: mutual TLS as the cluster's operator, with this process's
TLS folder when it has one, else a CA made for the run and removed after it; `off`: plaintext,
`--insecure-internal`), making clients under one of them (a `DistStoreClient` reads the
process-wide setting when it is made, and picks UCX by it at each call), the interleaved
rounds over TCP (each round times one write and read of the raw transport and one put and get
of the store, with TLS and without, the order flipped every round so that drift hits both
settings alike), the cipher a data connection negotiates, and the machine's crypto ceiling
(`openssl speed -evp aes-256-gcm` at 16 KiB, a TLS record's size, on one core). Must not start
stores (`kvstore_procs`, `kvstore_link`) or compute ratios (`kvstore_summary`).
"""

from __future__ import annotations

import logging
import re
import shutil
import socket
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from pdserve.bench import kvstore_measure as m
from pdserve.core.identity import NODE, OPERATOR, server_name
from pdserve.security import pki, tls

MODES = ("on", "off", "both")
ON, OFF = "on", "off"
OPENSSL_BYTES = 16384  # the largest TLS record's payload: what the data plane encrypts at once


def modes_of(mode: str) -> tuple[str, ...]:
    """The settings a run measures: ("on",), ("off",) or ("on", "off")."""
    if mode not in MODES:
        raise ValueError(f"--internal-tls must be one of {', '.join(MODES)}, got {mode!r}")
    return (ON, OFF) if mode == "both" else (mode,)


class BenchTls:
    """This run's internal-TLS settings; on exit, this process's own setting is put back and a
    CA made for the run removed."""

    def __init__(self, mode: str) -> None:
        self.modes = modes_of(mode)
        self.mode = mode
        self.settings: dict[str, tls.Security] = {}
        self.source = None  # where the TLS folder came from
        self._tmp: str | None = None
        self._saved: tls.Security | None = None
        self._was_set = False

    def __enter__(self) -> BenchTls:
        self._was_set = tls.is_configured()
        self._saved = tls.current() if self._was_set else None
        if ON in self.modes:
            try:
                mine = tls.current()
            except tls.NotConfigured:
                mine = None
            if isinstance(mine, tls.MutualTls):
                folder = mine.folder.path
                self.source = f"this process's TLS folder ({folder})"
            else:
                self._tmp = tempfile.mkdtemp(prefix="pdserve-bench-tls-")
                folder = f"{self._tmp}/tls"
                pki.init_folder(folder, "bench")
                self.source = "a CA made for this run"
            self.settings[ON] = tls.MutualTls(tls.TlsFolder(folder), OPERATOR)
        if OFF in self.modes:
            self.settings[OFF] = tls.Insecure()
        self._set(self.settings[self.main])
        return self

    def __exit__(self, *exc: object) -> None:
        if self._was_set and self._saved is not None:
            self._set(self._saved)
        else:
            tls.reset()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    @property
    def main(self) -> str:
        """The setting of the figures measured once (shared memory, batch gets): TLS whenever
        it is measured, as `pdserve serve` runs."""
        return self.modes[0]

    @staticmethod
    def _set(security: tls.Security) -> None:
        quiet = logging.getLogger(tls.__name__)
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # the plaintext warning, once per switch, says nothing new
        try:
            tls.configure(security)
        finally:
            quiet.setLevel(level)

    @contextmanager
    def using(self, mode: str) -> Iterator[tls.Security]:
        """This process's setting is `mode`'s within the block (clients made, UCX picked)."""
        self._set(self.settings[mode])
        try:
            yield self.settings[mode]
        finally:
            self._set(self.settings[self.main])

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "measured": list(self.modes), "main": self.main,
                "folder": self.source}


@dataclass
class TcpPath:
    """One setting's TCP path to one node: the raw transport with its reserved extent, and a
    store client that reaches the node over TCP (another host id)."""

    transport: Any
    extent: Any
    client: Any


def tcp_rounds(paths: dict[str, TcpPath], src: np.ndarray, dst: np.ndarray, rounds: int,
               label: str) -> dict[str, dict[str, dict[str, list[float]]]]:
    """`rounds` rounds; in each, for every setting (order flipped each round): one raw write
    and read_into, one store put and get. {mode: {"raw": {"put_s", "get_s"}, "pdserve": ...}},
    the lists in round order. The first round is checked byte for byte."""
    out = {mode: {"raw": {"put_s": [], "get_s": []}, "pdserve": {"put_s": [], "get_s": []}}
           for mode in paths}
    order = list(paths)
    for r in range(rounds):
        for mode in (order if r % 2 == 0 else order[::-1]):
            p, got = paths[mode], out[mode]
            put, get = m.raw_round(p.transport, p.extent, src, dst, check=r == 0)
            got["raw"]["put_s"].append(put)
            got["raw"]["get_s"].append(get)
            put, get = m.client_round(p.client, src, dst, f"{label}-{mode}", check=r == 0)
            got["pdserve"]["put_s"].append(put)
            got["pdserve"]["get_s"].append(get)
    return out


def warm(paths: dict[str, TcpPath], size: int = 1 << 20) -> None:
    """One untimed round per setting: the connections (and TLS handshakes) are made here."""
    src = m.payload(size, seed=7)
    dst = np.empty_like(src)
    for p in paths.values():
        m.raw_round(p.transport, p.extent, src, dst, check=True)
        m.client_round(p.client, src, dst, "warm", check=True)


def negotiated(address: str, security: tls.MutualTls) -> dict[str, Any]:
    """The TLS version and cipher a data connection to the node at `address` negotiates (one
    handshake with this process's client context, as TcpTransport makes it)."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=10) as raw:
        with security.client_context().wrap_socket(raw, server_hostname=server_name(NODE)) as s:
            name, version, bits = s.cipher()
            return {"version": s.version(), "cipher": name, "bits": bits}


def openssl_speed(seconds: int = 1) -> dict[str, Any]:
    """`openssl speed -evp aes-256-gcm` at 16 KiB blocks on one core: GB/s (1e9 B/s) of the
    cipher alone, or why not."""
    import ssl

    exe = shutil.which("openssl")
    cmd = ["openssl", "speed", "-evp", "aes-256-gcm", "-bytes", str(OPENSSL_BYTES),
           "-seconds", str(seconds), "-mr"]
    out: dict[str, Any] = {"command": " ".join(cmd[:-1]), "block_bytes": OPENSSL_BYTES,
                           "python_ssl": ssl.OPENSSL_VERSION}
    if exe is None:
        return {**out, "gbps": None, "reason": "openssl not found on PATH"}
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        version = subprocess.run(["openssl", "version"], capture_output=True, text=True,
                                 timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return {**out, "gbps": None, "reason": f"{type(e).__name__}: {e}"}
    found = re.search(r"^\+F:\d+:[^:]+:([0-9.]+)", run.stdout, re.MULTILINE)
    if run.returncode != 0 or not found:
        return {**out, "gbps": None,
                "reason": f"exit {run.returncode}: {(run.stderr or run.stdout)[-300:]}"}
    return {**out, "gbps": float(found.group(1)) / 1e9, "openssl": version, "reason": None}
