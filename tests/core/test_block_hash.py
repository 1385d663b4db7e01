"""Chained block hashes: stable values (they key blocks in the store and the router's index
across processes and versions), resumable chains, salts that separate tenants."""

from __future__ import annotations

import itertools

import pytest

from pdserve.core.block_hash import hash_block, iter_block_hashes, prompt_block_hashes


def test_values_are_stable():
    # Blocks written to the store by one version are found by the next only if names agree.
    assert hash_block(None, [1, 2, 3, 4]).hex() == "b0982e408b995b4e853d73d20ad2023c"
    assert hash_block(None, [1, 2, 3, 4], "tenant-a").hex() == "724dce98ebe0faa078f032ad5710ef45"
    assert prompt_block_hashes(list(range(8)), 4)[1].hex() == "08594d9bb218665b8ffc65a0948e9674"


def test_chain_covers_everything_before_a_block():
    a = prompt_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = prompt_block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different parent
    assert prompt_block_hashes([1, 2, 3, 4], 4, "x") != prompt_block_hashes([1, 2, 3, 4], 4, "y")


def test_partial_block_only_when_asked():
    toks = list(range(10))
    assert len(prompt_block_hashes(toks, 4)) == 2
    with_partial = prompt_block_hashes(toks, 4, include_partial=True)
    assert with_partial[:2] == prompt_block_hashes(toks, 4)
    assert with_partial[2] == hash_block(with_partial[1], [8, 9])
    assert prompt_block_hashes([], 4, include_partial=True) == []


def test_resuming_a_chain_gives_the_same_hashes():
    toks = list(range(40))
    full = prompt_block_hashes(toks, 4)
    tail = list(iter_block_hashes(toks, 4, first=3, parent=full[2]))
    assert tail == full[3:]
    assert list(iter_block_hashes(toks, 4, end_block=5)) == full[:5]


def test_hashing_is_lazy():
    hashed = list(itertools.islice(iter_block_hashes(list(range(4000)), 4), 2))
    assert len(hashed) == 2


def test_bad_block_size_names_it():
    with pytest.raises(ValueError, match="block_size"):
        prompt_block_hashes([1, 2], 0)
