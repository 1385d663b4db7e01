"""Client library of the KV-cache store, and the canonical form of its keys.

Owns `KVStoreClient` (put_from / get_into on caller buffers, batches, typed errors), the
structured block key `BlockKey` and its string form (`format_key` / `parse_key`). Must not import
`pdserve.engine` or interpret the bytes it moves.

Transient failures (UNAVAILABLE, DEADLINE_EXCEEDED: the store process restarting) are retried
within each operation's budget (`kvstore.retry`); once an operation found no store, the next ones
fail fast until one gets an answer. The channel reconnects within a second of the store's return.

This first version copies: `put_from` copies the caller's buffer into the request message and
`get_into` copies the reply into the caller's buffer. The signatures are already those of a
zero-copy store (after Mooncake): a later transport (shared memory, RDMA/UCX) writes straight
into, and reads straight from, buffers the caller has registered, with no change to callers.
"""

from __future__ import annotations

import collections
import enum
import functools
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, TypeVar
from urllib.parse import quote, unquote

import grpc

from pdserve.kvstore.channel import make_store_channel
from pdserve.kvstore.errors import NotStored
from pdserve.kvstore.retry import TRANSIENT_CODES, StoreRetryPolicy
from pdserve.kvstore.store import (
    ChecksumMismatch,
    ObjectMeta,
    StoreError,
    StoreFullError,
    StoreStats,
)
from pdserve.proto import kvstore_pb2 as pb
from pdserve.proto import kvstore_pb2_grpc as pb_grpc

# Anything exporting the buffer protocol, C-contiguous: bytes, bytearray, memoryview, numpy array.
BufferLike = Any

# Puts in flight at once in batch_put_from: each holds a copy of its data until answered.
_MAX_INFLIGHT_PUTS = 8

_T = TypeVar("_T")


class KeyNotFound(StoreError, NotStored):
    """One or more keys are not in the store; `keys` lists them."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = tuple(keys)
        super().__init__(f"not in the store: {', '.join(self.keys)}")


class BufferTooSmall(StoreError):
    """The caller's buffer cannot hold the object."""


class StoreUnavailable(StoreError):
    """The store did not answer (down, unreachable, or past the deadline); a retry may succeed."""


class Plane(enum.IntEnum):
    """Bit plane of a KV block; values equal `pdserve.v1.Plane`."""

    FULL = 0  # all bits
    ANCHOR = 1  # high-order bits, sent first
    RESIDUAL = 2  # the remaining low-order bits


@dataclass(frozen=True)
class BlockKey:
    """Structured key of one KV block object (mirrors `pdserve.v1.KvKey`)."""

    model_id: str
    tenant_salt: str
    block_hash: bytes
    layer_start: int
    layer_end: int  # exclusive
    plane: Plane = Plane.FULL

    def __post_init__(self) -> None:
        object.__setattr__(self, "plane", Plane(self.plane))
        if not self.model_id:
            raise ValueError("model_id must not be empty")
        if not self.block_hash:
            raise ValueError("block_hash must not be empty")
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(
                f"need 0 <= layer_start < layer_end, got {self.layer_start}..{self.layer_end}"
            )

    def to_proto(self) -> pb.KvKey:
        return pb.KvKey(
            model_id=self.model_id,
            tenant_salt=self.tenant_salt,
            block_hash=self.block_hash,
            layer_start=self.layer_start,
            layer_end=self.layer_end,
            plane=int(self.plane),
        )

    @classmethod
    def from_proto(cls, key: pb.KvKey) -> BlockKey:
        return cls(
            key.model_id, key.tenant_salt, key.block_hash, key.layer_start, key.layer_end,
            Plane(key.plane),
        )


def format_key(key: BlockKey | pb.KvKey) -> str:
    """Canonical store key: `kv/{model_id}/{tenant_salt}/{hash_hex}/L{start}-{end}/{plane}`.

    model_id and tenant_salt are percent-encoded with no safe characters, so neither can contain
    "/" and a model id like "org/name" cannot shift the fields. Accepts a BlockKey or a KvKey.
    """
    if isinstance(key, pb.KvKey):
        key = BlockKey.from_proto(key)
    return (
        f"kv/{quote(key.model_id, safe='')}/{quote(key.tenant_salt, safe='')}/"
        f"{key.block_hash.hex()}/L{key.layer_start}-{key.layer_end}/{key.plane.name.lower()}"
    )


def parse_key(text: str) -> BlockKey:
    """Inverse of format_key; raises ValueError naming the text when it is not a block key."""
    parts = text.split("/")
    try:
        prefix, model, salt, hash_hex, layers, plane = parts
        start, end = layers.removeprefix("L").split("-")
        if prefix != "kv" or not layers.startswith("L"):
            raise ValueError("bad prefix")
        return BlockKey(
            unquote(model), unquote(salt), bytes.fromhex(hash_hex), int(start), int(end),
            Plane[plane.upper()],
        )
    except (ValueError, KeyError) as e:
        raise ValueError(f"not a block key: {text!r} ({e})") from None


def _byte_view(buffer: BufferLike, *, writable: bool) -> memoryview:
    """A flat unsigned-byte view of `buffer` (no copy)."""
    view = memoryview(buffer)
    if writable and view.readonly:
        raise TypeError("buffer is read-only; get_into needs a writable buffer")
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _meta_of(
    buffer: BufferLike, view: memoryview, meta: ObjectMeta | None, crc: int
) -> pb.ObjectMeta:
    if meta is not None:
        dtype, shape = meta.dtype, meta.shape
    elif hasattr(buffer, "dtype") and hasattr(buffer, "shape"):  # numpy and friends
        dtype, shape = str(buffer.dtype), tuple(buffer.shape)
    else:
        dtype, shape = "uint8", (view.nbytes,)
    # The checksum always comes from the bytes actually sent, never from the caller's meta.
    return pb.ObjectMeta(dtype=dtype, shape=shape, checksum=crc)


def _to_store_error(e: grpc.RpcError, what: str) -> StoreError:
    code, details = e.code(), e.details()
    message = f"{what}: {details}"
    # The store answers RESOURCE_EXHAUSTED only for an object bigger than its capacity; gRPC
    # itself uses it for a message over the 256 MiB limit. Either way the object cannot go in.
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return StoreFullError(message)
    if code == grpc.StatusCode.DATA_LOSS:
        return ChecksumMismatch(message)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return StoreUnavailable(f"{what}: {code.name}: {details}")
    return StoreError(f"{what}: {code.name}: {details}")


class KVStoreClient:
    """Talks to one store process. Thread-safe (one gRPC channel shared by all calls)."""

    def __init__(self, address: str, timeout_s: float = 30.0,
                 retry: StoreRetryPolicy | None = None) -> None:
        """`timeout_s` bounds one attempt; `retry` (default: a budget of `timeout_s`) the
        retries of transient failures of one operation."""
        self.address = address
        self._timeout_s = timeout_s
        self.retry = retry or StoreRetryPolicy(budget_s=timeout_s, attempt_timeout_s=timeout_s)
        self.store_down = False  # an operation found no store; the next ones fail fast
        self._channel = make_store_channel(address)
        self._stub = pb_grpc.KVStoreStub(self._channel)

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def put_from(self, key: str, buffer: BufferLike, meta: ObjectMeta | None = None) -> int:
        """Stores the bytes of `buffer` under `key`; returns how many objects were evicted.

        dtype and shape come from `meta`, else from the buffer (numpy), else "uint8" bytes.
        Raises StoreFullError if the object exceeds the store's capacity.
        """
        request = self._put_request(key, buffer, meta)
        return self._unary(self._stub.Put, request, f"put {key}").evicted_objects

    def batch_put_from(
        self,
        items: Iterable[tuple[str, BufferLike] | tuple[str, BufferLike, ObjectMeta | None]],
    ) -> int:
        """put_from for many (key, buffer[, meta]) items, pipelined; returns total evictions.

        On the first failure the puts still in flight are cancelled and the error raised; puts
        already answered stay stored.
        """
        requests = []
        for item in items:
            key, buffer, meta = item[0], item[1], (item[2] if len(item) > 2 else None)
            requests.append((key, self._put_request(key, buffer, meta)))
        # Puts are idempotent (keys name content): after a transient failure the whole batch
        # goes again.
        return self._retried(lambda timeout: self._put_pipelined(requests, timeout),
                             f"put of {len(requests)} objects")

    def _put_pipelined(self, requests: list[tuple[str, pb.PutRequest]], timeout: float) -> int:
        pending: collections.deque[tuple[str, grpc.Future]] = collections.deque()
        evicted = 0
        try:
            for key, request in requests:
                pending.append((key, self._stub.Put.future(request, timeout=timeout)))
                if len(pending) >= _MAX_INFLIGHT_PUTS:
                    evicted += pending.popleft()[1].result().evicted_objects
            while pending:
                evicted += pending.popleft()[1].result().evicted_objects
        finally:
            for _, future in pending:
                future.cancel()
        return evicted

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None if the key is not stored."""
        response = self._unary(self._stub.Get, pb.GetRequest(key=key), f"get {key}")
        return self._checked_data(response) if response.found else None

    def get_into(self, key: str, buffer: BufferLike) -> int:
        """Copies the object into the caller's writable `buffer`; returns the bytes written.

        Raises KeyNotFound, or BufferTooSmall (the buffer is left untouched).
        """
        view = _byte_view(buffer, writable=True)
        response = self._unary(self._stub.Get, pb.GetRequest(key=key), f"get {key}")
        if not response.found:
            raise KeyNotFound([key])
        return self._copy_into(response, view)

    def readers(self, keys: Sequence[str]) -> list[Callable[[BufferLike], int]]:
        """One reader per key: `reader(buffer)` is `get_into(key, buffer)` (the store server
        holds the objects itself: there is nothing to locate first)."""
        return [functools.partial(self.get_into, key) for key in keys]

    def batch_get_into(
        self, keys: Sequence[str], buffers: Sequence[BufferLike], *, missing_ok: bool = False
    ) -> list[int | None]:
        """get_into for many keys in one streamed call; returns bytes written per key.

        A missing key gives None when `missing_ok`; otherwise, after every present key has been
        copied, KeyNotFound lists all the missing ones.
        """
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        views = [_byte_view(b, writable=True) for b in buffers]

        def attempt(timeout: float) -> tuple[list[int | None], list[str]]:
            written: list[int | None] = []
            missing: list[str] = []
            responses = self._stub.BatchGet(pb.BatchGetRequest(keys=keys), timeout=timeout)
            try:
                for key, view, response in zip(keys, views, responses, strict=True):
                    assert response.key == key, "the store answers BatchGet in request order"
                    if response.found:
                        written.append(self._copy_into(response, view))
                    else:
                        written.append(None)
                        missing.append(key)
            finally:
                responses.cancel()  # no-op when the stream ended; frees it after an early error
            return written, missing

        written, missing = self._retried(attempt, f"batch get of {len(keys)} keys")
        if missing and not missing_ok:
            raise KeyNotFound(missing)
        return written

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key, in order (does not refresh recency)."""
        response = self._unary(self._stub.Exists, pb.ExistsRequest(keys=keys), "exists")
        return list(response.exists)

    def longest_prefix(self, keys: Sequence[str]) -> int:
        """How many leading keys of a block chain are stored (the same call as the distributed
        store's, answered here with one exists())."""
        n = 0
        for present in self.exists(keys) if keys else []:
            if not present:
                break
            n += 1
        return n

    def remove(self, key: str) -> bool:
        """Deletes `key`; returns whether it existed."""
        return self._unary(self._stub.Remove, pb.RemoveRequest(key=key), f"remove {key}").found

    def stats(self) -> StoreStats:
        s = self._unary(self._stub.Stats, pb.StoreStatsRequest(), "stats")
        return StoreStats(
            object_count=s.object_count,
            used_bytes=s.used_bytes,
            capacity_bytes=s.capacity_bytes,
            puts=s.puts,
            gets=s.gets,
            hits=s.hits,
            misses=s.misses,
            evictions=s.evictions,
        )

    def _put_request(self, key: str, buffer: BufferLike, meta: ObjectMeta | None) -> pb.PutRequest:
        if not key:
            raise ValueError("key must not be empty")
        view = _byte_view(buffer, writable=False)
        data = view.tobytes()  # the copy a registered-buffer transport will remove
        meta_pb = _meta_of(buffer, view, meta, zlib.crc32(data))
        return pb.PutRequest(key=key, data=data, meta=meta_pb)

    @staticmethod
    def _checked_data(response: pb.GetResponse) -> bytes:
        data = response.data  # each access copies out of the message: read it once
        # End-to-end check: the checksum was computed by the writer before the bytes left it.
        if zlib.crc32(data) != response.meta.checksum:
            raise ChecksumMismatch(f"get {response.key}: data does not match its crc32")
        return data

    def _copy_into(self, response: pb.GetResponse, view: memoryview) -> int:
        data = self._checked_data(response)
        if len(data) > view.nbytes:
            raise BufferTooSmall(
                f"get {response.key}: object is {len(data)} bytes, buffer holds {view.nbytes}"
            )
        view[: len(data)] = data
        return len(data)

    def _unary(self, method: Callable[..., _T], request: object, what: str) -> _T:
        return self._retried(lambda timeout: method(request, timeout=timeout), what)

    def _retried(self, attempt: Callable[[float], _T], what: str) -> _T:
        """attempt(timeout) until it answers, as `self.retry` allows; a typed StoreError.
        Each attempt gets the whole `timeout_s`: the bytes travel in the call, so a large put
        may take long; a store that is down refuses the connection at once anyway."""
        started = time.monotonic()
        rounds = 0
        while True:
            rounds += 1
            try:
                out = attempt(self._timeout_s)
                self.store_down = False
                return out
            except grpc.RpcError as e:
                if e.code().name not in TRANSIENT_CODES:
                    self.store_down = False  # the store answered, if only to refuse
                    raise _to_store_error(e, what) from e
                d = self.retry.decide(rounds, e.code().name, time.monotonic() - started,
                                      self.store_down)
                if not d.retry:
                    self.store_down = True
                    raise _to_store_error(e, what) from e
                time.sleep(d.delay_s)
