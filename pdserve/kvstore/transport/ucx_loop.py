"""One asyncio loop per process that owns every `ucxx` call, on a daemon thread.

Owns importing `ucxx` (lazily: importing it starts UCX, which a process that never crosses hosts
should not pay for) and running coroutines on the loop from ordinary threads (`run`). ucxx's
async API binds its worker to the loop it first runs on, so the node's listener and a client's
endpoints in the same process share this one loop. Must not know the data protocol.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from typing import Any

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def import_ucxx():
    """`ucxx`, imported with UCX's warnings about unrelated environment variables silenced."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx  # noqa: PLC0415 - lazy on purpose

    return ucxx


def loop() -> asyncio.AbstractEventLoop:
    """The process's UCX loop, started on first use."""
    global _loop
    with _lock:
        if _loop is None:
            import_ucxx()
            new = asyncio.new_event_loop()
            ready = threading.Event()

            def main() -> None:
                asyncio.set_event_loop(new)
                new.call_soon(ready.set)
                new.run_forever()

            threading.Thread(target=main, name="ucx-loop", daemon=True).start()
            ready.wait()
            _loop = new
        return _loop


def run(coro: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
    """Runs `coro` on the UCX loop and waits for its result (TimeoutError past `timeout_s`)."""
    future = asyncio.run_coroutine_threadsafe(coro, loop())
    try:
        return future.result(timeout_s)
    except TimeoutError:
        future.cancel()
        raise
