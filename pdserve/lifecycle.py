"""A child process of `pdserve serve` ends when its parent does, even after kill -9 of the parent.

The launcher sets PDSERVE_DIE_WITH_PARENT to its pid; each service's `main` calls
`die_with_parent_if_asked()` first, which asks Linux for SIGTERM on the parent's death (the
child's own handlers then shut it down cleanly). This runs in the child after exec, not in a
`preexec_fn` between fork and exec: forking a process whose gRPC threads are running ran gRPC's
fork handlers in the child, which aborted it now and then ("epoll_wait error: Bad file
descriptor"); without a preexec_fn, Python spawns with vfork/posix_spawn and no fork handlers run.
"""

from __future__ import annotations

import ctypes
import os
import signal

ENV = "PDSERVE_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1


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
    except OSError:
        return  # not Linux: the launcher's stop() still ends its children
    if os.getppid() != int(parent):  # the parent died before we asked
        os.kill(os.getpid(), signal.SIGTERM)
