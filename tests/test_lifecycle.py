"""A child asked to die with its parent (`pdserve.lifecycle`) is gone soon after a kill -9 of
the parent: by the kernel's SIGTERM and its own handler, or, when that handler never returns,
by the watchdog's deadline. Real processes; the hung shutdown is a handler that sleeps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.helpers import REPO_ROOT, wait_until

# The child: asks to die with its parent, makes SIGTERM's clean shutdown hang (as a shutdown step
# waiting on a dead peer would), says it is ready, then idles.
_CHILD = """
import os, signal, sys, time
from pdserve import lifecycle
lifecycle.ORPHAN_EXIT_S = float(sys.argv[1])
lifecycle.die_with_parent_if_asked()
def hang(signum, frame):
    time.sleep(600)
signal.signal(signal.SIGTERM, hang)
print(os.getpid(), flush=True)
time.sleep(600)
"""

_PARENT = """
import subprocess, sys, time
from pdserve.lifecycle import child_env
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE,
                         env=child_env(), text=True)
print(child.stdout.readline().strip(), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie counts as gone
    except OSError:
        return False


def test_an_orphan_whose_shutdown_hangs_still_exits_after_the_deadline():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _CHILD, "2"], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert _alive(pid)
        killed = time.monotonic()
        parent.kill()
        parent.wait()
        assert wait_until(lambda: not _alive(pid), timeout_s=20), "the orphan outlived its deadline"
        assert time.monotonic() - killed >= 2.0  # its shutdown had the whole deadline first
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.stdout.close()


def test_a_child_whose_parent_lives_is_left_alone():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _CHILD, "0.05"], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        # An absence, so no condition to wait on: past the watchdog's first poll (0.25 s) plus
        # its deadline, a watchdog that fired with the parent alive would have ended it.
        time.sleep(0.4)
        assert _alive(pid)
        parent.kill()
        parent.wait()
        assert wait_until(lambda: not _alive(pid), timeout_s=20)
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.stdout.close()
        if _alive(pid):
            os.kill(pid, 9)


_FLOODED = """
import sys, threading
from pdserve.lifecycle import StopSignals
ev = threading.Event()
StopSignals(ev)
for _ in range(1000):  # waiters make Event.set hold its lock longer: a wider window
    threading.Thread(target=ev.wait, daemon=True).start()
print("ready", flush=True)
ev.wait()
print("stopped", flush=True)
"""


def test_a_stop_signal_handler_returns_while_the_event_lock_is_held():
    import threading

    from pdserve.lifecycle import StopSignals

    ev = threading.Event()
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop = StopSignals(ev)
        # As when a second signal interrupts the first handler inside Event.set: the handler
        # runs on a thread that holds the event's lock. It must return, not wait for it.
        with ev._cond:
            stop._on_signal(signal.SIGTERM, None)
            assert not ev.is_set()
        assert ev.wait(5.0)  # the relay thread set it once the lock was free
        assert stop.received == [signal.SIGTERM]
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_a_flood_of_stop_signals_stops_the_process():
    # Ctrl-C in a shell whose trap also sends SIGTERM: signals back to back. With a handler
    # that called Event.set, 1 or 2 in 10 such processes hung for good.
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for _ in range(5):
        p = subprocess.Popen([sys.executable, "-c", _FLOODED], stdout=subprocess.PIPE,
                             text=True, env=env)
        try:
            assert p.stdout.readline().strip() == "ready"
            for i in range(300):
                try:
                    os.kill(p.pid, signal.SIGTERM if i % 2 else signal.SIGINT)
                except ProcessLookupError:
                    break
            assert p.wait(timeout=10) == 0
            assert p.stdout.read().strip() == "stopped"
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()


_TAKEN_ELSEWHERE = """
import signal, threading
from pdserve.lifecycle import StopSignals
ev = threading.Event()
stop = StopSignals(ev)
# Only another thread can take the signal: the kernel never interrupts the main thread's wait.
threading.Thread(target=threading.Event().wait, daemon=True).start()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
print("ready", flush=True)
ev.wait()
print("stopped", stop.first == signal.SIGTERM, flush=True)
"""


def test_a_stop_signal_another_thread_takes_still_stops_a_main_thread_asleep_on_a_lock():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    p = subprocess.Popen([sys.executable, "-c", _TAKEN_ELSEWHERE], stdout=subprocess.PIPE,
                         text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "ready"
        os.kill(p.pid, signal.SIGTERM)
        assert p.wait(timeout=10) == 0
        assert p.stdout.read().strip() == "stopped True"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
