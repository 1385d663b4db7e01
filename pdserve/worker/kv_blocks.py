"""Engine KV blocks <-> store objects: the key of a block and its bytes.

Owns the mapping between an engine block tensor [layers, 2, block_size, kv_heads, head_dim] and a
store object (one object per block covering every layer, plane FULL). Blocks may live in device
memory: they leave and enter it through the process's host staging pool (`kv_staging`: pinned
buffers, asynchronous copies); CPU blocks are handed to the store zero-copy. Progressive
transfer streams (span, layer) anchor/residual planes under its own keys instead (`kv_stream`).
An emulated engine's blocks are bytes (`engine/emulated.py`): put as they are, fetched into
bytes of its block size, and torch is never imported for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from pdserve.core.block_hash import prompt_block_hashes
from pdserve.kvstore.client import BlockKey, Plane, StoreError, format_key
from pdserve.kvstore.dist_client import DistStoreError
from pdserve.kvstore.store import ObjectMeta
from pdserve.worker.guarded_store import StoreFailure
from pdserve.worker.kv_staging import HostStaging, default_staging
from pdserve.worker.torch_lazy import torch

# Whatever keeps a block from being read: the caller recomputes it.
_MISSING = (StoreError, DistStoreError, StoreFailure, KeyError, OSError)

_BYTES = (bytes, bytearray, memoryview)  # an emulated engine's blocks


def block_key(model_id: str, salt: str, block_hash: bytes, num_layers: int) -> str:
    return format_key(BlockKey(model_id, salt, block_hash, 0, num_layers, Plane.FULL))


def reusable_prefix(engine, model_id: str, prompt_ids: list[int], salt: str
                    ) -> tuple[list[bytes], list[str]]:
    """The hashes and store keys of the prompt's blocks another request can reuse: its full
    blocks before the last prompt token (one token must be computed to sample from)."""
    hashes = prompt_block_hashes(prompt_ids[:-1], engine.block_size, salt)
    layers = engine.model_config.num_hidden_layers
    return hashes, [block_key(model_id, salt, h, layers) for h in hashes]


def block_meta(block: torch.Tensor | bytes) -> ObjectMeta:
    if isinstance(block, _BYTES):
        return ObjectMeta("uint8", (len(block),))
    return ObjectMeta(str(block.dtype).removeprefix("torch."), tuple(block.shape))


@contextlib.contextmanager
def blocks_as_buffers(blocks: list[torch.Tensor] | list[bytes], staging: HostStaging | None = None
                      ) -> Iterator[list[tuple[memoryview, ObjectMeta]]]:
    """(bytes, meta) of each block for a store put, valid inside the `with` block: CPU blocks'
    own bytes, device blocks' bytes copied to host staging first, emulated blocks as they are."""
    if blocks and isinstance(blocks[0], _BYTES):
        yield [(memoryview(b), block_meta(b)) for b in blocks]
        return
    with (staging or default_staging()).host_views(blocks) as views:
        yield [(v, block_meta(b)) for v, b in zip(views, blocks)]


def put_missing(store, keys: list[str], blocks: list[torch.Tensor]) -> int:
    """Put the blocks the store lacks (one `exists` asked for all, one batch put); how many
    were put. Raises what the store or the staging raise (StoreFailure, StagingError)."""
    if not keys:
        return 0
    present = store.exists(keys)
    todo = [(k, b) for k, b, p in zip(keys, blocks, present) if not p]
    if todo:  # device blocks go through host staging; CPU blocks are put zero-copy
        with blocks_as_buffers([b for _, b in todo]) as bufs:
            store.batch_put_from([(k, *buf) for (k, _), buf in zip(todo, bufs)])
    return len(todo)


def _readers(store, keys: list[str]) -> list[Callable[[Any], int]]:
    """Per key, a reader of the object into a writable buffer (bytearray, numpy array) that
    gives -1 when it cannot; the objects located with one store call. None can be read when
    that call fails."""
    def safe(read: Callable[[Any], int]) -> Callable[[Any], int]:
        def go(buf: Any) -> int:
            try:
                return read(buf)
            except _MISSING:  # missing, evicted, node lost, corrupt, the store down: recompute
                return -1
        return go
    try:
        return [safe(r) for r in store.readers(keys)]
    except _MISSING:
        return []


def fetch_block(store, key: str, engine, staging: HostStaging | None = None
                ) -> torch.Tensor | None:
    """Read one block from the store into a fresh block tensor on the engine's device; None if
    unavailable.

    Works with either store client (both have `readers`); any store error means "not there":
    the caller recomputes what it cannot fetch.
    """
    if _byte_blocks(engine):
        got = _fetch_bytes(engine.kv.block_bytes, _readers(store, [key]))
        return got[0] if got else None
    got = (staging or default_staging()).fetch_many(
        engine.kv.block_shape(), engine.model.dtype, engine.kv.k.device, _readers(store, [key]))
    return got[0] if got else None


def fetch_run(store, engine, hashes: list[bytes], keys: list[str],
              staging: HostStaging | None = None) -> list[tuple[bytes, torch.Tensor]]:
    """Fetch blocks in order until the first one the store cannot give; the rest is recomputed.
    On a GPU a block's copy to the device overlaps the next block's read."""
    if _byte_blocks(engine):
        return list(zip(hashes, _fetch_bytes(engine.kv.block_bytes, _readers(store, keys))))
    got = (staging or default_staging()).fetch_many(
        engine.kv.block_shape(), engine.model.dtype, engine.kv.k.device,
        _readers(store, keys))
    return list(zip(hashes, got))


def _byte_blocks(engine) -> bool:
    """Whether the engine's KV blocks are bytes (an emulated engine's)."""
    return isinstance(getattr(engine.kv, "block_bytes", None), int)


def _fetch_bytes(nbytes: int, reads: list[Callable[[bytearray], int]]) -> list[bytes]:
    """Blocks of `nbytes` bytes, in order, until the first one that cannot be read whole."""
    out = []
    for read in reads:
        buf = bytearray(nbytes)
        if read(buf) != nbytes:
            break
        out.append(bytes(buf))
    return out
