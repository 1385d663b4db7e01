"""Engine KV blocks <-> store objects: the key of a block and its bytes.

Owns the mapping between an engine block tensor [layers, 2, block_size, kv_heads, head_dim] and a
store object (one object per block covering every layer, plane FULL in this first format). The
progressive-transfer format splits planes and layer ranges under the same keys' scheme.
"""

from __future__ import annotations

import torch

from pdserve.kvstore.client import BlockKey, Plane, format_key
from pdserve.kvstore.store import ObjectMeta

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


def block_key(model_id: str, salt: str, block_hash: bytes, num_layers: int) -> str:
    return format_key(BlockKey(model_id, salt, block_hash, 0, num_layers, Plane.FULL))


def block_to_buffer(block: torch.Tensor) -> tuple[memoryview, ObjectMeta]:
    """A byte view of a contiguous block (no copy) and its meta."""
    flat = block.contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()), ObjectMeta(_DTYPE_NAMES[block.dtype], tuple(block.shape))


def buffer_to_block(data: bytes | bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    buf = bytearray(data) if isinstance(data, bytes) else data
    return torch.frombuffer(buf, dtype=torch.uint8).view(_DTYPES[dtype]).reshape(shape)
