"""Engine KV blocks <-> store objects: the key of a block and its bytes.

Owns the mapping between an engine block tensor [layers, 2, block_size, kv_heads, head_dim] and a
store object (one object per block covering every layer, plane FULL). Progressive transfer
streams (span, layer) anchor/residual planes under its own keys instead (`kv_stream`).
"""

from __future__ import annotations

import torch

from pdserve.kvstore.client import BlockKey, Plane, StoreError, format_key
from pdserve.kvstore.dist_client import DistStoreError
from pdserve.kvstore.store import ObjectMeta
from pdserve.worker.guarded_store import StoreFailure

# Whatever keeps a block from being read: the caller recomputes it.
_MISSING = (StoreError, DistStoreError, StoreFailure, KeyError, OSError)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def block_key(model_id: str, salt: str, block_hash: bytes, num_layers: int) -> str:
    return format_key(BlockKey(model_id, salt, block_hash, 0, num_layers, Plane.FULL))


def block_to_buffer(block: torch.Tensor) -> tuple[memoryview, ObjectMeta]:
    """A byte view of a contiguous block (no copy) and its meta."""
    flat = block.contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()), ObjectMeta(_DTYPE_NAMES[block.dtype], tuple(block.shape))


def fetch_block(store, key: str, engine) -> torch.Tensor | None:
    """Read one block from the store straight into a fresh block tensor; None if unavailable.

    Works with either store client (both have `get_into`); any store error means "not there":
    the caller recomputes what it cannot fetch.
    """
    block = torch.empty(engine.kv.block_shape(), dtype=engine.model.dtype)
    try:
        n = store.get_into(key, block.view(-1).view(torch.uint8).numpy())
    except _MISSING:  # missing, evicted, node lost, corrupt, the store down: recompute
        return None
    return block if n == block.numel() * block.element_size() else None


def fetch_run(store, engine, hashes: list[bytes], keys: list[str]
              ) -> list[tuple[bytes, torch.Tensor]]:
    """Fetch blocks in order until the first one the store cannot give; the rest is recomputed."""
    out = []
    for h, key in zip(hashes, keys):
        data = fetch_block(store, key, engine)
        if data is None:
            break
        out.append((h, data))
    return out
