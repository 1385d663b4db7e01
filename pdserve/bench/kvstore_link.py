"""A link of a real NIC's speed for `pdserve bench kvstore`: a storage node in another network
namespace, joined by a veth pair whose two ends are rate-limited (`tc qdisc ... tbf`).

Loopback moves bytes at memory-copy speed, which no NIC does, so a TLS/plaintext ratio on
loopback says what encryption costs against a memcpy, not against a network. Here each
direction of the veth pair is shaped to `rate` (default 10 Gbit/s, 1.25 GB/s) by a token
bucket; the store (master on the host's end, node in the namespace) is reached over it with TLS
and without, in the same interleaved rounds as on loopback. Needs root and iproute2 (`ip`,
`tc`); without them the document says why. Owns making and removing the namespace, the pair
and the shaping, however the run ends. Must not time anything (`kvstore_tls.tcp_rounds` does).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

RATE = "10gbit"
# The bucket. Tokens pile up while the link idles, so an object smaller than the bucket
# crosses at memory speed: it must be small beside the objects sent. Measured here at 10 Gbit/s
# (plaintext, best of 4): 64 KiB let through 0.82 GB/s (the VM's timer cannot refill it fast
# enough), 512 KiB 1.16 GB/s at 64 MiB and 1.22-1.26 at 4 MiB (nominal 1.25), 1 MiB let 1 MiB
# objects through at 1.6-2.7 GB/s. `latency` bounds the queue (and so the memory) it holds.
BURST = "512kb"
LATENCY = "20ms"


class LinkUnavailable(RuntimeError):
    """This machine cannot make the namespace, the pair or the shaping; the message says why."""


def rate_gbps(rate: str) -> float:
    """GB/s (1e9 bytes/s) of a `tc` rate such as "10gbit" or "2500mbit"."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8 / 1e9
    raise ValueError(f"--link-rate wants a rate like 10gbit or 2500mbit, got {rate!r}")


def why_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (a network namespace, a veth pair and tc shaping)"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"needs iproute2: {', '.join(missing)} not found on PATH"
    return None


def _sh(*args: str) -> None:
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        raise LinkUnavailable(f"`{' '.join(args)}` failed: {r.stderr.strip()[-300:]}")


class ShapedLink:
    """A namespace `ns` joined to this one by a veth pair, each end shaped to `rate`:
    `host_ip` on this side, `ns_ip` in the namespace, `prefix` runs a command inside it."""

    def __init__(self, rate: str = RATE) -> None:
        self.rate = rate
        tag = f"{os.getpid() % 100000}"
        self.ns, self._host_if, self._ns_if = f"pdb{tag}", f"pdb{tag}a", f"pdb{tag}b"
        subnet = f"10.214.{os.getpid() % 250}"
        self.host_ip, self.ns_ip = f"{subnet}.1", f"{subnet}.2"
        self.prefix: tuple[str, ...] = ("ip", "netns", "exec", self.ns)
        self._made = False

    def start(self) -> ShapedLink:
        why = why_unavailable()
        if why:
            raise LinkUnavailable(why)
        rate_gbps(self.rate)
        self._made = True
        in_ns = self.prefix
        _sh("ip", "netns", "add", self.ns)
        _sh("ip", "link", "add", self._host_if, "type", "veth", "peer", "name", self._ns_if)
        _sh("ip", "link", "set", self._ns_if, "netns", self.ns)
        _sh("ip", "addr", "add", f"{self.host_ip}/24", "dev", self._host_if)
        _sh("ip", "link", "set", self._host_if, "up")
        _sh(*in_ns, "ip", "addr", "add", f"{self.ns_ip}/24", "dev", self._ns_if)
        _sh(*in_ns, "ip", "link", "set", self._ns_if, "up")
        _sh(*in_ns, "ip", "link", "set", "lo", "up")
        shape = ("qdisc", "add", "dev")
        tbf = ("root", "tbf", "rate", self.rate, "burst", BURST, "latency", LATENCY)
        _sh("tc", *shape, self._host_if, *tbf)  # this side -> the node: puts
        _sh(*in_ns, "tc", *shape, self._ns_if, *tbf)  # the node -> this side: gets
        return self

    def describe(self) -> dict[str, Any]:
        return {"rate": self.rate, "nominal_gbps": rate_gbps(self.rate), "burst": BURST,
                "latency": LATENCY,
                "how": f"veth pair to network namespace {self.ns}, each end shaped by "
                       f"`tc qdisc add dev IF root tbf rate {self.rate} burst {BURST} "
                       f"latency {LATENCY}`; node in the namespace, master and client here"}

    def stop(self) -> None:
        if self._made:
            subprocess.run(["ip", "link", "del", self._host_if], capture_output=True)
            subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
            self._made = False

    def __enter__(self) -> ShapedLink:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
