"""The worker's store client, guarded: every call's outcome feeds the worker's `StoreHealth`.

Owns the boundary between the roles and the store. A call the store cannot serve (no master
answers, no node, a put refused, every replica unreadable, a master of another cluster) raises
`StoreFailure` after it is counted; a miss (the object is not stored) is an answer and passes
through unchanged. The probe thread asks the store (`stats`) once at start (a store that does
not answer yet shows at once), then, while degraded, every `probe_interval_s` in which no other
call was made, so degraded mode clears when the store is back even on an idle worker. Must not decide what a role does about a failure (it recomputes) nor retry:
the store client retries within its own budget.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, TypeVar

from pdserve.kvstore.errors import KVStoreError, NotStored, StoreError
from pdserve.worker.store_health import StoreHealth, StoreHealthView

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_MISS = NotStored  # either client's miss: KeyNotFound, ObjectNotFound
_FAILURE = (KVStoreError, OSError)  # either client's failure: StoreError, DistStoreError


class StoreFailure(Exception):
    """The KV store could not serve a call; the message says which and why. The worker serves
    the request without the store (the decode side recomputes the prompt's KV)."""


class GuardedStore:
    def __init__(self, store, health: StoreHealth | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.health = health or StoreHealth()
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the store's calls, as the roles use them --------------------------------------------
    def longest_prefix(self, keys) -> int:
        return self._guard("longest_prefix", lambda: self.store.longest_prefix(keys))

    def exists(self, keys) -> list[bool]:
        return self._guard("exists", lambda: self.store.exists(keys))

    def batch_put_from(self, items):
        return self._guard("put", lambda: self.store.batch_put_from(items))

    def get_into(self, key: str, buffer) -> int:
        return self._guard("get", lambda: self.store.get_into(key, buffer))

    def readers(self, keys) -> list[Callable[[Any], int]]:
        """The store's readers (one lookup for all the keys), each read guarded."""
        def guarded(read: Callable[[Any], int]) -> Callable[[Any], int]:
            return lambda buffer: self._guard("get", lambda: read(buffer))
        return [guarded(r) for r in self._guard("get", lambda: self.store.readers(keys))]

    @property
    def reads_by_transport(self) -> dict:
        return getattr(self.store, "reads_by_transport", {})

    def view(self) -> StoreHealthView:
        with self._lock:
            return self.health.view()

    def _guard(self, op: str, fn: Callable[[], _T]) -> _T:
        try:
            out = fn()
        except _MISS:
            self._record(op, None)
            raise
        except _FAILURE as e:
            self._record(op, e)
            raise StoreFailure(f"KV store unavailable ({op}): {e}") from e
        self._record(op, None)
        return out

    def _record(self, op: str, error: BaseException | None) -> None:
        now = self._clock()
        with self._lock:
            was = self.health.view().degraded
            if error is None:
                self.health.succeeded(op, now)
            else:
                self.health.failed(op, str(error), now)
            now_degraded = self.health.view()
        if now_degraded.degraded != was:
            if now_degraded.degraded:
                log.warning("KV store degraded: %s; serving by recomputation",
                            now_degraded.reason)
            else:
                log.info("KV store serves again: degraded mode over")

    # ---- the probe ---------------------------------------------------------------------------
    def probe(self) -> bool:
        """Asks the store whether it is whole (a master answers, a storage node is registered);
        clears degraded mode if so. True when it is."""
        try:
            stats = self.store.stats()
        except _FAILURE as e:
            self._record("probe", e)
            return False
        if getattr(stats, "nodes_alive", 1) < 1:  # the distributed store's master
            self._record("probe", StoreError("no storage node is registered with the master"))
            return False
        with self._lock:
            was = self.health.view().degraded
            self.health.whole(self._clock())
        if was:
            log.info("KV store serves again (probe): degraded mode over")
        return True

    def start(self, poll_s: float = 0.25) -> "GuardedStore":
        def run() -> None:
            try:
                self.probe()
            except Exception:  # noqa: BLE001 - logged; the loop below probes again
                log.exception("store probe failed")
            while not self._stop.wait(poll_s):
                with self._lock:
                    due = self.health.probe_due(self._clock())
                if due:
                    try:
                        self.probe()
                    except Exception:  # keep probing; the next round may succeed
                        log.exception("store probe failed")

        self._thread = threading.Thread(target=run, name="store-probe", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.store.close()
