"""Chained content hashes of KV blocks: the one definition every hop uses.

Owns how a block of token ids is named: a block's hash covers its parent's hash, its tokens and
a salt (the tenant), so two prompts share a block only if they share everything before it too,
and one tenant never hits another's blocks. The engine's prefix cache, the KV export keys, the
router's KV index and the simulator all name blocks with these functions, so a hash computed on
one hop finds the block on another.
Must not import torch or know where a block lives.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence


def hash_block(parent: bytes | None, token_ids: Sequence[int], salt: str = "") -> bytes:
    """The hash of one block: its parent's hash (the salt for the first block) and its tokens."""
    return _hash_text(parent, ",".join(map(str, token_ids)).encode(), salt)


def _hash_text(parent: bytes | None, text: bytes, salt: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or salt.encode())
    h.update(b"|")
    h.update(text)
    return h.digest()


def iter_block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "", *,
                      first: int = 0, parent: bytes | None = None,
                      end_block: int | None = None) -> Iterator[bytes]:
    """Chained hashes of the full blocks `first`, `first + 1`, ... of `token_ids` (up to
    `end_block`, exclusive); `parent` is the hash of block `first - 1` (None when `first` is 0).
    Lazy, so a prefix lookup stops hashing at its first miss.

    A container of token ids may spell a block itself: `token_ids.block_text(start, end)`,
    if it has one, must return exactly the bytes `hash_block` hashes for
    `token_ids[start:end]` (the ids in decimal, comma-separated), only faster."""
    if block_size <= 0:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n_full = len(token_ids) // block_size
    end = n_full if end_block is None else min(end_block, n_full)
    text_of = getattr(token_ids, "block_text", None)
    for i in range(first, end):
        if text_of is None:
            parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], salt)
        else:
            parent = _hash_text(parent, text_of(i * block_size, (i + 1) * block_size), salt)
        yield parent


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "",
                        include_partial: bool = False) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids` (and of the trailing partial one if asked)."""
    hashes = list(iter_block_hashes(token_ids, block_size, salt))
    start = len(hashes) * block_size
    if include_partial and start < len(token_ids):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start:], salt))
    return hashes
