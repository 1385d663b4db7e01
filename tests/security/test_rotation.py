"""Certificates rotated on disk are used without a restart, with a real store master process:
its listener presents the new certificate (and trusts the new CA) to the next connection, and a
client's long-lived channel moves to the new files when it reconnects."""

from __future__ import annotations

import os
import shutil
import sys
import time

import grpc
import pytest

from pdserve import rpc
from pdserve.core.identity import MASTER, OPERATOR
from pdserve.proto import kvmaster_pb2 as pb
from pdserve.proto import kvmaster_pb2_grpc as pb_grpc
from pdserve.security import pki, tls
from tests.helpers import free_port, start_process, stop_process


def _rotate(folder: str, fresh: str) -> None:
    """Replace every file of `folder` by `fresh`'s, as a renewal or a Secret update does (each
    key before its certificate, each file atomically)."""
    for name in sorted(os.listdir(fresh), key=lambda n: (not n.endswith(".key"), n)):
        pki.write_atomic(os.path.join(folder, name), pki.read(os.path.join(fresh, name)),
                         0o600 if name.endswith(".key") else 0o644)


def _stats(address: str, security: tls.Security, channel=None):
    ch = channel or rpc.make_channel(address, MASTER, security_=security)
    try:
        return pb_grpc.KVMasterStub(ch).Stats(pb.MasterStatsRequest(), timeout=5)
    finally:
        if channel is None:
            ch.close()


def _master(folder: str, journal: str, address: str):
    return start_process([sys.executable, "-m", "pdserve.kvstore.master", "--address", address,
                          "--journal-dir", journal, "--tls-dir", folder], address,
                         timeout_s=30, security=tls.MutualTls(tls.TlsFolder(folder), OPERATOR))


def test_a_rotated_certificate_and_ca_are_picked_up_without_a_restart(tmp_path):
    served, before, after = (str(tmp_path / n) for n in ("served", "before", "after"))
    pki.init_folder(served, "c")
    shutil.copytree(served, before)
    pki.init_folder(after, "c-next")  # a new CA too: the hardest rotation
    address = f"127.0.0.1:{free_port()}"
    p = _master(served, str(tmp_path / "journal"), address)
    try:
        old = tls.MutualTls(tls.TlsFolder(before), OPERATOR)
        assert _stats(address, old).nodes_alive == 0
        _rotate(served, after)
        new = tls.MutualTls(tls.TlsFolder(after), OPERATOR)
        deadline = time.monotonic() + 10
        while True:  # the server looks at its files at most once a second
            try:
                _stats(address, new)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as e:  # the old CA's certificates no longer get in
            _stats(address, old)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert p.poll() is None  # the same process throughout
    finally:
        stop_process(p)


def test_a_clients_channel_follows_its_rotated_files(tmp_path):
    served, client, fresh = (str(tmp_path / n) for n in ("served", "client", "fresh"))
    pki.init_folder(served, "c")
    shutil.copytree(served, client)
    pki.init_folder(fresh, "c-next")
    address = f"127.0.0.1:{free_port()}"
    journal = str(tmp_path / "journal")
    p = _master(served, journal, address)
    me = tls.MutualTls(tls.TlsFolder(client, check_interval_s=0.0), OPERATOR)
    channel = rpc.make_channel(address, MASTER, security_=me)  # long-lived, like a worker's
    try:
        assert _stats(address, me, channel).nodes_alive == 0
        first = channel.current()
        # The cluster rotates to a new CA: the master's folder and this client's, then the
        # master restarts (its old connections go; the client must reconnect with new files).
        _rotate(served, fresh)
        _rotate(client, fresh)
        stop_process(p)
        p = _master(served, journal, address)
        assert _stats(address, me, channel).nodes_alive == 0
        assert channel.current() is not first
    finally:
        channel.close()
        stop_process(p)
