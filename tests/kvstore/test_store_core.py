"""The store's pure core (LRU, capacity, checksums, counters), its config and its key format."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kvstore.client import BlockKey, Plane, format_key, parse_key
from pdserve.core.errors import ConfigError
from pdserve.kvstore.config import StoreConfig
from pdserve.kvstore.store import ChecksumMismatch, MemoryStore, ObjectMeta, StoreFullError
from pdserve.proto import kvstore_pb2


def meta_for(data: bytes) -> ObjectMeta:
    return ObjectMeta(dtype="uint8", shape=(len(data),), checksum=zlib.crc32(data))


def put(store: MemoryStore, key: str, size: int, fill: int = 0) -> int:
    data = bytes([fill]) * size
    return store.put(key, data, meta_for(data))


def make_store(capacity_bytes: int = 100, **sizes: int) -> MemoryStore:
    store = MemoryStore(capacity_bytes)
    for key, size in sizes.items():
        put(store, key, size)
    return store


def test_put_then_get_returns_data_and_meta() -> None:
    store = MemoryStore(100)
    data = b"hello"
    meta = ObjectMeta(dtype="float16", shape=(1, 2), checksum=zlib.crc32(data))
    store.put("k", data, meta)
    obj = store.get("k")
    assert obj is not None and obj.data == data and obj.meta == meta
    assert store.get("missing") is None


def test_evicts_least_recently_used_first() -> None:
    store = make_store(100, a=30, b=30, c=30)
    assert store.get("a") is not None  # a is now the most recently used: b is the oldest
    assert put(store, "d", 30) == 1
    assert store.lru_keys() == ["c", "a", "d"]
    assert put(store, "e", 50) == 2  # needs c and a gone
    assert store.lru_keys() == ["d", "e"]
    assert store.stats().evictions == 3


def test_exists_does_not_refresh_recency() -> None:
    store = make_store(100, a=50, b=50)
    assert store.exists(["a", "x", "b"]) == [True, False, True]
    put(store, "c", 10)
    assert store.exists(["a", "b", "c"]) == [False, True, True]


def test_replacing_a_key_frees_the_old_bytes_and_is_not_an_eviction() -> None:
    store = make_store(100, a=60, b=30)
    assert put(store, "a", 70, fill=1) == 0
    assert store.stats().used_bytes == 100 and store.stats().evictions == 0
    assert store.get("a").data == bytes([1]) * 70


def test_object_larger_than_capacity_raises_and_leaves_store_unchanged() -> None:
    store = make_store(100, a=40)
    with pytest.raises(StoreFullError, match="101 bytes exceeds the store capacity of 100"):
        put(store, "a", 101)
    assert store.get("a").data == bytes(40)
    assert store.stats().used_bytes == 40 and store.stats().puts == 1
    put(store, "exact", 100)  # exactly the capacity fits, after evicting everything else
    assert store.lru_keys() == ["exact"]


def test_checksum_mismatch_is_rejected_and_leaves_store_unchanged() -> None:
    store = make_store(100, a=10)
    data = b"payload"
    bad = ObjectMeta(checksum=zlib.crc32(data) ^ 1)
    with pytest.raises(ChecksumMismatch, match="'a'"):
        store.put("a", data, bad)
    assert store.get("a").data == bytes(10)


def test_counters() -> None:
    store = make_store(100, a=10)
    store.get("a")
    store.get("b")
    assert store.remove("a") and not store.remove("a")
    s = store.stats()
    assert (s.object_count, s.used_bytes, s.capacity_bytes) == (0, 0, 100)
    assert (s.puts, s.gets, s.hits, s.misses, s.evictions) == (1, 2, 1, 1, 0)


ops = st.lists(
    st.tuples(st.sampled_from(["put", "get", "remove"]), st.sampled_from("abcdef"),
              st.integers(0, 64)),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_capacity_is_never_exceeded_and_accounting_matches(script) -> None:
    store = MemoryStore(128)
    model: dict[str, int] = {}  # key -> size, in recency order
    for op, key, size in script:
        if op == "put":
            put(store, key, size)
            model.pop(key, None)
            model[key] = size
            while sum(model.values()) > 128:
                del model[next(iter(model))]
        elif op == "get":
            if store.get(key) is not None:
                model[key] = model.pop(key)
        else:
            store.remove(key)
            model.pop(key, None)
        assert store.stats().used_bytes == sum(model.values()) <= 128
        assert store.lru_keys() == list(model)


# --- config -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"address": "nohostport"}, "address"),
        ({"address": "127.0.0.1:http"}, "address"),
        ({"address": "127.0.0.1:70000"}, "address port"),
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"max_workers": 0}, "max_workers"),
        ({"shutdown_grace_s": -1.0}, "shutdown_grace_s"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(overrides, field) -> None:
    with pytest.raises(ConfigError, match=field):
        StoreConfig(**overrides)


def test_config_defaults_are_valid() -> None:
    assert StoreConfig().address == "127.0.0.1:50070"


# --- key format ---------------------------------------------------------------------------


def test_format_key_is_canonical_and_escapes_slashes() -> None:
    key = BlockKey("HuggingFaceTB/SmolLM2-135M", "tenant a", bytes.fromhex("9f86d081"), 0, 30,
                   Plane.ANCHOR)
    text = format_key(key)
    assert text == "kv/HuggingFaceTB%2FSmolLM2-135M/tenant%20a/9f86d081/L0-30/anchor"
    assert parse_key(text) == key
    assert format_key(key.to_proto()) == text


def test_plane_values_match_the_proto_enum() -> None:
    assert {p.name: p.value for p in Plane} == {
        name.removeprefix("PLANE_"): value for name, value in kvstore_pb2.Plane.items()
    }


@given(
    st.text(min_size=1), st.text(), st.binary(min_size=1, max_size=32),
    st.integers(0, 200), st.integers(1, 200), st.sampled_from(list(Plane)),
)
@settings(max_examples=100, deadline=None)
def test_key_round_trips(model, salt, block_hash, start, length, plane) -> None:
    key = BlockKey(model, salt, block_hash, start, start + length, plane)
    assert parse_key(format_key(key)) == key


@pytest.mark.parametrize("bad", ["", "kv/m/s/zz/L0-1/full", "kv/m/s/ab/L1-0/full",
                                 "kv/m/s/ab/L0-1/half", "x/m/s/ab/L0-1/full", "kv/m/s/ab/0-1/full"])
def test_parse_key_rejects_non_block_keys(bad) -> None:
    with pytest.raises(ValueError, match="not a block key"):
        parse_key(bad)
