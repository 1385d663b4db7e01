"""Request bytes that do not parse: INVALID_ARGUMENT naming the method, over a real channel.

A servicer registered with `rpc.add_servicer` on a real in-process gRPC server is sent garbage
bytes through raw (unserialized) calls of every arity, by the method's path alone and through
the generated stub (gRPC's registered-method path); valid requests still reach the servicer.
The router process itself is checked in tests/fuzz.
"""

from __future__ import annotations

import grpc
import pytest

from pdserve import rpc
from pdserve.core.identity import WORKER
from pdserve.proto import api_pb2, api_pb2_grpc
from tests.helpers import free_port

# Corrupt for any message: a bad tag; a field longer than the bytes; an unterminated varint.
GARBAGE = (b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x08\x80\x80")
BAD_UTF8_PROMPT = b"\x1a\x02\xff\xfe"  # GenerateRequest.prompt (field 3) with bytes no UTF-8


class _Echo(api_pb2_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.seen: list[object] = []

    def Generate(self, request, context):
        self.seen.append(request)
        yield api_pb2.GenerateResponse(request_id=request.request_id, text=request.prompt)

    def ListModels(self, request, context):
        self.seen.append(request)
        return api_pb2.ListModelsResponse(models=[api_pb2.ModelInfo(id="m")])


def _count(requests, context):
    return api_pb2.ListModelsResponse(models=[api_pb2.ModelInfo(id=str(len(list(requests))))])


def _add_counter(servicer, server) -> None:
    """A client-streaming method (none of pdserve's protos has one), registered the same way."""
    handlers = {"Count": grpc.stream_unary_rpc_method_handler(
        _count, request_deserializer=api_pb2.ListModelsRequest.FromString,
        response_serializer=api_pb2.ListModelsResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Counter",
                                                                          handlers),))


@pytest.fixture(scope="module")
def served():
    server = rpc.make_server(4)
    echo = _Echo()
    rpc.add_servicer(server, api_pb2_grpc.add_GenerationServicer_to_server, echo, None)
    rpc.add_servicer(server, _add_counter, None, None)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    try:
        with rpc.make_channel(address, rpc.PUBLIC) as channel:
            yield channel, echo
    finally:
        server.stop(grace=None)


@pytest.mark.parametrize("data", GARBAGE)
def test_garbage_gets_invalid_argument_naming_the_method_for_every_arity(served, data):
    channel, echo = served
    seen = len(echo.seen)
    calls = {
        "/pdserve.v1.Generation/Generate": lambda: list(channel.unary_stream(
            "/pdserve.v1.Generation/Generate")(data, timeout=10)),
        "/pdserve.v1.Generation/ListModels": lambda: channel.unary_unary(
            "/pdserve.v1.Generation/ListModels")(data, timeout=10),
        "/t.Counter/Count": lambda: channel.stream_unary("/t.Counter/Count")(
            iter([b"", data]), timeout=10),
    }
    for method, call in calls.items():
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value)
        assert e.value.details().startswith(f"{method}: the request does not parse"), \
            e.value.details()
    assert len(echo.seen) == seen  # the servicer never saw them


def test_a_string_field_with_bad_utf8_gets_invalid_argument(served):
    channel, echo = served
    with pytest.raises(grpc.RpcError) as e:
        list(channel.unary_stream("/pdserve.v1.Generation/Generate")(BAD_UTF8_PROMPT,
                                                                     timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in e.value.details(), e.value.details()


def test_valid_requests_reach_the_servicer_through_both_paths(served):
    channel, echo = served
    stub = api_pb2_grpc.GenerationStub(channel)  # registered methods
    [r] = list(stub.Generate(api_pb2.GenerateRequest(request_id="a", prompt="hi"), timeout=10))
    assert (r.request_id, r.text) == ("a", "hi")
    assert stub.ListModels(api_pb2.ListModelsRequest(), timeout=10).models[0].id == "m"
    raw = channel.unary_stream("/pdserve.v1.Generation/Generate")  # generic lookup by path
    [data] = list(raw(api_pb2.GenerateRequest(prompt="yo").SerializeToString(), timeout=10))
    assert api_pb2.GenerateResponse.FromString(data).text == "yo"
    counted = channel.stream_unary("/t.Counter/Count")(iter([b"", b""]), timeout=10)
    assert api_pb2.ListModelsResponse.FromString(counted).models[0].id == "2"
    with pytest.raises(grpc.RpcError) as e:  # unknown methods stay UNIMPLEMENTED
        channel.unary_unary("/pdserve.v1.Generation/Nope")(b"", timeout=10)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _started(server: grpc.Server, kind: str) -> str:
    """`server` listening on a free loopback port (the client API's plaintext for PUBLIC, the
    suite's mutual TLS for a cluster kind) and started; its address."""
    address = f"127.0.0.1:{free_port()}"
    if kind == rpc.PUBLIC:
        rpc.bind_public(server, address, None)
    else:
        rpc.bind(server, address, kind)
    server.start()
    return address


def test_the_receive_bound_refuses_larger_messages_with_resource_exhausted():
    server = rpc.make_server(2, max_receive_message_bytes=1024)
    rpc.add_servicer(server, api_pb2_grpc.add_GenerationServicer_to_server, _Echo(), None)
    address = _started(server, rpc.PUBLIC)
    try:
        with rpc.make_channel(address, rpc.PUBLIC) as channel:
            stub = api_pb2_grpc.GenerationStub(channel)
            assert list(stub.Generate(api_pb2.GenerateRequest(prompt="x" * 900), timeout=10))
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(api_pb2.GenerateRequest(prompt="x" * 2000), timeout=10))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        server.stop(grace=None)
    with pytest.raises(ValueError, match="max_receive_message_bytes"):
        rpc.make_server(2, max_receive_message_bytes=0)


class _Held(api_pb2_grpc.GenerationServicer):
    """Generate streams until `release` is set: calls that hold their handler thread."""

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()
        self.started = threading.Semaphore(0)

    def Generate(self, request, context):
        self.started.release()
        self.release.wait(30)
        yield api_pb2.GenerateResponse(request_id=request.request_id, text="done")


def test_calls_past_the_servers_bound_get_resource_exhausted_with_a_retry_hint():
    import threading

    held, refused = _Held(), []
    server = rpc.make_server(3, maximum_concurrent_rpcs=3, on_busy=lambda: refused.append(1))
    rpc.add_servicer(server, api_pb2_grpc.add_GenerationServicer_to_server, held, None)
    health = rpc.add_health_and_reflection(server, ["pdserve.v1.Generation"])
    # Bound as a worker's internal listener is (mutual TLS): every bounded server refuses so.
    address = _started(server, WORKER)
    try:
        with rpc.make_channel(address, WORKER) as channel:
            stub = api_pb2_grpc.GenerationStub(channel)
            results: list = [None] * 3

            def hold(i: int) -> None:
                results[i] = [r.text for r in stub.Generate(api_pb2.GenerateRequest(
                    request_id=f"h{i}", prompt="x"), timeout=60)]
            threads = [threading.Thread(target=hold, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            for _ in range(3):
                assert held.started.acquire(timeout=30)
            # Three calls hold the bound: more are refused at once, with the hint, unseen.
            for i in range(5):
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.Generate(api_pb2.GenerateRequest(request_id=f"x{i}"), timeout=10))
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "holds 3 calls at once; retry after 1s" in e.value.details()
                assert dict(e.value.trailing_metadata())["retry-after"] == "1"
            assert len(refused) == 5
            # Health still answers past the bound.
            from grpc_health.v1 import health_pb2, health_pb2_grpc
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            held.release.set()
            for t in threads:
                t.join(30)
            assert results == [["done"]] * 3
            # Freed, the server serves again.
            held.release.set()
            assert [r.text for r in stub.Generate(api_pb2.GenerateRequest(request_id="after"),
                                                  timeout=30)] == ["done"]
    finally:
        health.enter_graceful_shutdown()
        server.stop(grace=None)
