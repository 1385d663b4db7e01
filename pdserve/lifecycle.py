"""A child process of `pdserve serve` ends when its parent does, even after kill -9 of the parent.

The launcher sets PDSERVE_DIE_WITH_PARENT to its pid; each service's `main` calls
`die_with_parent_if_asked()` first, which asks Linux for SIGTERM on the parent's death (the
child's own handlers then shut it down cleanly). This runs in the child after exec, not in a
`preexec_fn` between fork and exec: forking a process whose gRPC threads are running ran gRPC's
fork handlers in the child, which aborted it now and then ("epoll_wait error: Bad file
descriptor"); without a preexec_fn, Python spawns with vfork/posix_spawn and no fork handlers run.

The clean shutdown is bounded: a watchdog thread notices the orphaning too (its parent pid
changes), sends the SIGTERM itself where the kernel cannot (not Linux), and ends the process with exit
code 1 if it is still alive `ORPHAN_EXIT_S` later, since a shutdown step waiting on a peer that
died with the launcher must not keep it alive.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

ENV = "PDSERVE_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1
ORPHAN_EXIT_S = 10.0  # how long an orphaned child may take to shut down cleanly
_POLL_S = 0.25


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that should die with this process."""
    out = dict(os.environ if env is None else env)
    out[ENV] = str(os.getpid())
    return out


def die_with_parent_if_asked() -> None:
    parent = os.environ.get(ENV)
    if not parent:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        kernel_signals = True
    except OSError:
        kernel_signals = False  # not Linux: the watchdog sends the SIGTERM
    threading.Thread(target=_watch_parent, args=(int(parent), not kernel_signals),
                     name="parent-watchdog", daemon=True).start()
    if kernel_signals and os.getppid() != int(parent):  # the parent died before we asked
        os.kill(os.getpid(), signal.SIGTERM)


def _watch_parent(parent: int, send_term: bool) -> None:
    while os.getppid() == parent:
        time.sleep(_POLL_S)
    if send_term:
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(ORPHAN_EXIT_S)
    print(f"pdserve: parent {parent} died and the clean shutdown took over {ORPHAN_EXIT_S:g}s; "
          "exiting now", file=sys.stderr, flush=True)
    os._exit(1)
