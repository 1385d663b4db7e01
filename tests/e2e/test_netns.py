"""Another host: the decode worker runs in its own network namespace, joined by a veth pair,
and pulls its KV from the store's node over the network (TCP, or UCX when the node serves it).
Output equals the engine's.

Needs root and iproute2 (`ip netns`); otherwise it skips and says why. The UCX case also needs
`ucxx` (PyPI `ucxx-cu12`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from pdserve import rpc
from pdserve.core.identity import MASTER
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.proto import kvmaster_pb2 as kpb
from pdserve.proto import kvmaster_pb2_grpc as kpb_grpc
from pdserve.kvstore.transport.ucx import ucx_available
from pdserve.security import tls
from tests.e2e.test_cluster import generate, worker_stats
from tests.helpers import free_port, start_process, stop_process
from tests.kvstore.test_dist_store import stop

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and iproute2 to make a network namespace and a veth pair")


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@pytest.fixture
def netns():
    tag = f"{os.getpid() % 10000}"
    ns, host_if, ns_if = f"pdns{tag}", f"pdv{tag}a", f"pdv{tag}b"
    subnet = f"10.213.{os.getpid() % 250}"
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        sh("ip", "link", "set", ns_if, "netns", ns)
        sh("ip", "addr", "add", f"{subnet}.1/24", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{subnet}.2/24", "dev", ns_if)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, f"{subnet}.1", f"{subnet}.2"
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_decode_worker_on_another_host_pulls_kv_over_the_network(netns, tiny_llama_dir, tmp_path,
                                                                  transport, monkeypatch):
    if transport == "ucx":
        if not ucx_available():
            pytest.skip("ucxx is not installed (pip install ucxx-cu12)")
        # UCX carries KV bytes in plaintext: it runs only in a cluster without internal TLS
        # (--insecure-internal), so every process here, this one included, runs without.
        monkeypatch.delenv(tls.TLS_DIR_ENV, raising=False)
        monkeypatch.setenv(tls.INSECURE_ENV, "1")
        tls.configure(tls.Insecure())
    ns, host_ip, ns_ip = netns
    py = sys.executable
    procs = []
    try:
        master = f"{host_ip}:{free_port()}"
        procs.append(start_process([py, "-m", "pdserve.kvstore.master", "--address", master,
                                    "--journal-dir", str(tmp_path / "journal")], master))
        node = subprocess.Popen([py, "-m", "pdserve.kvstore.node", "--node-id", "netns-node",
                                 "--data-address", f"{host_ip}:0", "--dram-bytes", str(64 << 20),
                                 "--master", master,
                                 *(["--ucx-port", "0"] if transport == "ucx" else [])],
                                stdout=subprocess.PIPE, text=True)
        procs.append(node)
        assert node.stdout.readline()
        with rpc.make_channel(master, MASTER) as ch:
            stub = kpb_grpc.KVMasterStub(ch)
            deadline = time.monotonic() + 20
            while stub.Stats(kpb.MasterStatsRequest(), timeout=5).nodes_alive < 1:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        prefill = f"127.0.0.1:{free_port()}"
        procs.append(start_process([py, "-m", "pdserve.worker", "--role", "prefill", "--model",
                                    tiny_llama_dir, "--address", prefill, "--store-address",
                                    master, "--num-blocks", "64", "--threads", "1"],
                                   prefill, timeout_s=120))
        decode = f"{ns_ip}:{free_port()}"
        procs.append(start_process(["ip", "netns", "exec", ns, py, "-m", "pdserve.worker",
                                    "--role", "decode", "--model", tiny_llama_dir,
                                    "--address", decode, "--store-address", master,
                                    "--host-id", "the-other-host", "--num-blocks", "64",
                                    "--threads", "1"], decode, timeout_s=120))
        router = f"127.0.0.1:{free_port()}"
        procs.append(start_process([py, "-m", "pdserve.router", "--model", tiny_llama_dir,
                                    "--address", router, "--prefill", prefill,
                                    "--decode", decode], router, timeout_s=60))
        prompt = Tokenizer.from_path(tiny_llama_dir).encode("Across a veth pair " * 6)
        ids, *_ = generate(router, token_ids=prompt, max_tokens=24, ignore_eos=True)
        engine = LLMEngine(EngineConfig(tiny_llama_dir, cache=CacheConfig(num_blocks=64)))
        assert ids == engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
        stats = worker_stats(decode)
        assert stats.kv_blocks_fetched >= len(prompt) // 16
        # Every block crossed the veth pair over the transport under test (never shm).
        assert dict(stats.kv_store_reads_by_transport) == {transport: stats.kv_blocks_fetched}
    finally:
        for p in reversed(procs):
            if hasattr(p, "pdserve_stdout"):
                stop_process(p, timeout_s=15)
            else:
                stop(p)
