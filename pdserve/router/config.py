"""Configuration of the router process (one frozen dataclass, validated at the boundary)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.config import ConfigError


@dataclass(frozen=True)
class RouterConfig:
    model_path: str
    prefill_addresses: tuple[str, ...]
    decode_addresses: tuple[str, ...]
    address: str = "127.0.0.1:50051"
    model_name: str | None = None  # the id clients send in `model`; defaults to the file's name
    dtype: str = "float32"
    max_model_len_tokens: int | None = None
    rpc_threads: int = 64
    max_concurrent_rpcs: int = 256  # beyond this gRPC answers RESOURCE_EXHAUSTED
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.prefill_addresses:
            raise ConfigError("prefill_addresses: at least one prefill worker is needed")
        if not self.decode_addresses:
            raise ConfigError("decode_addresses: at least one decode worker is needed")
        if self.rpc_threads < 1 or self.max_concurrent_rpcs < 1:
            raise ConfigError("rpc_threads and max_concurrent_rpcs must be >= 1")
