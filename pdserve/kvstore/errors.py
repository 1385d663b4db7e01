"""The store's error family: one base for everything the store's parts raise.

Owns `KVStoreError` and its branches: `StoreError` (the single-process store's core and
client), `DistStoreError` (the distributed store's client), `MasterError` (the master's core);
`NotStored`, a miss, which both clients raise for an object that is not there (an answer, not
a failure); and `PutInProgress`, raised by the master's core and by the client it answers
alike, so it belongs to both branches. A caller of either client (the worker's guarded store)
catches `NotStored`, then `KVStoreError`. Each module re-exports its branch and its errors.
Must not import anything: every part of the store, pure cores included, imports it.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of every error the KV store's cores and clients raise."""


class NotStored(KVStoreError):
    """The object is not in the store: an answer, not a failure (the caller computes it)."""


class StoreError(KVStoreError):
    """Base of the single-process store's typed errors (raised by the core and by the client)."""


class DistStoreError(KVStoreError):
    """A distributed store operation failed; the message says which key and why."""


class MasterError(KVStoreError):
    """Base of the master's typed errors."""


class PutInProgress(MasterError, DistStoreError):
    """Another put of this key is pending (started, not yet committed or reclaimed): the
    master's core raises it, and the client raises it when the master answers ABORTED."""
