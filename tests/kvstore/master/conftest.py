"""A private redis-server per test module, for the journal and election tests.

Started with no persistence on a free loopback port and stopped after the module; tests get a
flushed client. Skips (with the reason) where redis-server is not installed.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from tests.helpers import free_port


@pytest.fixture(scope="module")
def redis_server():
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server not installed (.ci/run installs it)")
    redis = pytest.importorskip("redis")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
    deadline = time.monotonic() + 10
    try:
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {port} did not start: "
                                       f"{proc.stderr.read().decode(errors='replace')}")
                time.sleep(0.02)
        yield port
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stderr.close()


@pytest.fixture()
def redis_client(redis_server):
    import redis

    client = redis.Redis(host="127.0.0.1", port=redis_server, socket_timeout=5)
    client.flushall()
    yield client
    client.close()
