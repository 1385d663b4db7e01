"""Configuration of one store process: a frozen dataclass validated at construction.

Owns the store's settings and their validation. Must not open sockets or read the environment.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.core.errors import ConfigError
from pdserve.flags import flag


def parse_address(address: str) -> tuple[str, int]:
    """Splits "host:port" (IPv6 hosts in brackets) into host and port; raises ConfigError."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"address must be 'host:port', got {address!r}")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"address port must be an integer, got {address!r}") from None
    # Port 0 asks the OS for a free port; the service reports the one it got.
    if not 0 <= port <= 65535:
        raise ConfigError(f"address port must be in 0..65535, got {port}")
    return host, port


@dataclass(frozen=True)
class StoreConfig:
    """Settings of one in-memory store process."""

    # Where to listen, "host:port"; loopback by default because the store has no auth yet.
    address: str = flag("127.0.0.1:50070",
                        help="host:port to listen on (port 0: any free port)")
    # Most bytes of object data held; past it the least recently used objects are evicted.
    capacity_bytes: int = flag(1 << 30,
                               help="most bytes of object data held before LRU eviction")
    # gRPC handler threads: bounds concurrent requests being served.
    max_workers: int = flag(8, help="gRPC handler threads")
    # On SIGTERM, how long in-flight RPCs may run before they are cancelled.
    shutdown_grace_s: float = flag(5.0,
                                   help="seconds in-flight RPCs may still run after SIGTERM")

    def __post_init__(self) -> None:
        parse_address(self.address)
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes <= 0:
            raise ConfigError(
                f"capacity_bytes must be a positive integer, got {self.capacity_bytes!r}"
            )
        if not isinstance(self.max_workers, int) or self.max_workers < 1:
            raise ConfigError(f"max_workers must be an integer >= 1, got {self.max_workers!r}")
        if not self.shutdown_grace_s >= 0:
            raise ConfigError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s!r}")
