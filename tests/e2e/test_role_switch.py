"""A worker switches role through the control API, draining first, without reloading weights."""

from __future__ import annotations

import sys
import threading

import grpc
import pytest

from pdserve import rpc
from pdserve.core.identity import WORKER
from pdserve.proto import common_pb2
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc
from tests.helpers import free_port, start_process, stop_process


@pytest.fixture(scope="module")
def worker(tiny_llama_dir):
    store_addr = f"127.0.0.1:{free_port()}"
    store = start_process([sys.executable, "-m", "pdserve.kvstore", "--address", store_addr],
                          store_addr)
    addr = f"127.0.0.1:{free_port()}"
    proc = start_process([sys.executable, "-m", "pdserve.worker", "--role", "prefill", "--model",
                          tiny_llama_dir, "--address", addr, "--store-address", store_addr,
                          "--store-kind", "simple",
                          "--num-blocks", "64"], addr, timeout_s=120)
    ch = rpc.make_channel(addr, WORKER)
    yield wpb_grpc.WorkerStub(ch)
    ch.close()
    assert stop_process(proc, timeout_s=15) == 0
    stop_process(store)


def prefill(stub, rid: str, max_tokens: int = 4):
    return stub.Prefill(wpb.PrefillRequest(request_id=rid, prompt_token_ids=list(range(5, 45)),
                                           sampling=common_pb2.SamplingParams(max_tokens=max_tokens)),
                        timeout=60)


def test_switch_role_with_drain_keeps_the_loaded_weights(worker):
    first = prefill(worker, "a")
    assert len(first.kv.keys) == 3  # 40 tokens in blocks of 16
    # A prefill racing the switch either ran to completion (the switch drained it) or was
    # refused with a clear status; it is never cut off half way.
    results: list = []

    def racer():
        try:
            results.append(prefill(worker, "b"))
        except grpc.RpcError as e:
            results.append(e.code())

    t = threading.Thread(target=racer)
    t.start()
    resp = worker.SetRole(wpb.SetRoleRequest(role=wpb.ROLE_DECODE, drain=True,
                                             drain_timeout_s=60), timeout=90)
    t.join()
    assert resp.previous_role == wpb.ROLE_PREFILL and resp.role == wpb.ROLE_DECODE
    if isinstance(results[0], wpb.PrefillResponse):
        assert results[0].first_token_id == first.first_token_id
    else:
        assert results[0] in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION)
        assert resp.drained_requests == 0
    stats = worker.GetStats(wpb.GetStatsRequest(), timeout=10)
    assert stats.role == wpb.ROLE_DECODE and stats.role_switches == 1 and stats.weight_loads == 1
    # Now a prefill is refused, clearly, and a decode of the KV written before is served.
    with pytest.raises(grpc.RpcError) as err:
        prefill(worker, "c")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    chunks = list(worker.Decode(wpb.DecodeRequest(
        request_id="d", prompt_token_ids=list(range(5, 45)), first_token_id=first.first_token_id,
        sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True), kv=first.kv), timeout=60))
    assert sum(len(c.token_ids) for c in chunks) == 3  # the first token came from prefill
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    back = worker.SetRole(wpb.SetRoleRequest(role=wpb.ROLE_PREFILL, drain=True), timeout=60)
    assert back.role == wpb.ROLE_PREFILL
    assert worker.GetStats(wpb.GetStatsRequest(), timeout=10).weight_loads == 1


def test_set_role_rejects_an_unknown_role(worker):
    with pytest.raises(grpc.RpcError) as err:
        worker.SetRole(wpb.SetRoleRequest(role=wpb.ROLE_UNSPECIFIED), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "role" in err.value.details()
