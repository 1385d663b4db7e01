"""A storage node's segment file is gone after every exit path that can run code.

SIGTERM and SIGINT are in test_node_process.py. Here: an exception during start-up (a UCX port
asked for with UCX turned off), a master of another cluster refusing the node at registration,
the parent of a node started with `pdserve.lifecycle`'s die-with-parent dying by SIGKILL (the
node gets SIGTERM from the kernel), and SIGKILL of the node itself, which cannot be caught: the
next start of the same node id removes the file its predecessor left, and only that id's files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from pdserve.kvstore.node.config import NodeConfig
from pdserve.kvstore.node.service import StorageNode
from tests.helpers import REPO_ROOT, free_port
from tests.kvstore.test_dist_store import start_master, stop

from .conftest import MiB, node_args, node_stderr, start_node, stop_node, wait_until


def _run(args, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, **kw.pop("env", {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=60, **kw)


def test_an_exception_during_start_up_leaves_no_segment_file(shm_dir):
    p = _run(node_args("node-ucx", "127.0.0.1:0", MiB, shm_dir, "--ucx-port", "0",
                       "--insecure-internal"), env={"PDSERVE_UCX": "0", "PDSERVE_TLS_DIR": ""})
    assert p.returncode == 1 and "ucx_port is set" in p.stderr
    assert os.listdir(shm_dir) == []


def test_a_node_refused_by_a_master_of_another_cluster_exits_one_without_its_file(shm_dir,
                                                                                  tmp_path):
    master = f"127.0.0.1:{free_port()}"
    m = start_master(master, str(tmp_path / "journal"), "--cluster-id", "east")
    try:
        p = _run(node_args("node-west", "127.0.0.1:0", MiB, shm_dir, "--master", master,
                           "--cluster-id", "west"))
    finally:
        stop(m)
    assert p.returncode == 1
    assert "refused by the store master: cluster id mismatch" in p.stderr
    assert "'west'" in p.stderr and "'east'" in p.stderr
    assert os.listdir(shm_dir) == []


def test_a_node_of_the_same_cluster_or_of_none_is_accepted(shm_dir, tmp_path):
    master = f"127.0.0.1:{free_port()}"
    m = start_master(master, str(tmp_path / "journal"), "--cluster-id", "east")
    try:
        for node_id, cluster in (("same", "east"), ("unnamed", "")):
            p, ready = start_node(node_args(node_id, "127.0.0.1:0", MiB, shm_dir, "--master",
                                            master, "--cluster-id", cluster))
            assert stop_node(p) == 0, node_stderr(p)
    finally:
        stop(m)
    assert os.listdir(shm_dir) == []


# A parent that starts a node asked to die with it (as the launcher does), prints the node's
# ready line, then waits to be killed.
_PARENT = """
import subprocess, sys, time
from pdserve.lifecycle import child_env
node = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, env=child_env())
print(node.stdout.readline().decode().strip(), flush=True)
time.sleep(600)
"""


def test_a_node_whose_parent_is_killed_removes_its_segment_file(shm_dir):
    args = node_args("orphan", "127.0.0.1:0", MiB, shm_dir)
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, *args], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, text=True)
    ready = json.loads(parent.stdout.readline())
    path, pid = ready["segments"][0]["shm_path"], ready["pid"]
    assert os.path.exists(path)
    parent.kill()  # SIGKILL: the kernel sends the node SIGTERM (PR_SET_PDEATHSIG)
    parent.wait()
    parent.stdout.close()
    assert wait_until(lambda: not os.path.exists(path), timeout_s=20), "segment file left"
    assert wait_until(lambda: not _alive(pid), timeout_s=20), "the node outlived its parent"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_sigkill_leaves_the_file_and_the_next_start_of_that_id_removes_only_its_own(shm_dir):
    p, ready = start_node(node_args("n1", "127.0.0.1:0", MiB, shm_dir))
    stale = ready["segments"][0]["shm_path"]
    other = StorageNode(NodeConfig("n1.x", "test-host", MiB, shm_dir=shm_dir))
    other.start()  # another node id that starts like this one's files
    try:
        p.kill()
        p.wait()
        stop_node(p)
        assert os.path.exists(stale)
        p, again = start_node(node_args("n1", "127.0.0.1:0", MiB, shm_dir))
        assert not os.path.exists(stale)
        assert os.path.exists(again["segments"][0]["shm_path"])
        assert os.path.exists(other.info.segments[0].shm_path)  # not n1's to remove
        assert stop_node(p, signal.SIGTERM) == 0, node_stderr(p)
    finally:
        other.stop()
    assert os.listdir(shm_dir) == []
