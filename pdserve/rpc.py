"""Small gRPC helpers shared by every pdserve service and client.

Owns the server and channel options (message size limits), registering a servicer so that bytes
that do not parse as its request get INVALID_ARGUMENT naming the method (gRPC's own answer is
INTERNAL), standard health checking and server reflection, waiting for a service to become
healthy, and a service process's wait for SIGTERM.
Must not know any pdserve service: it takes service names as strings and never imports stubs.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent import futures
from typing import Any, Callable, Iterable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.lifecycle import StopSignals

# KV blocks of a long prompt run to tens of MiB per message in the first (copying) store
# transport; gRPC's 4 MiB default would reject them. 256 MiB bounds one message (invariant 5).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def make_server(max_workers: int, maximum_concurrent_rpcs: int | None = None,
                max_receive_message_bytes: int | None = None) -> grpc.Server:
    """A thread-pool gRPC server with pdserve's message size limits; not yet bound or started.

    `maximum_concurrent_rpcs` bounds RPCs in progress (queued for a thread or running); past it
    gRPC answers RESOURCE_EXHAUSTED at once instead of queueing without limit. None: no bound.
    `max_receive_message_bytes` lowers the largest request message accepted (default
    MAX_MESSAGE_BYTES): gRPC refuses a larger one with RESOURCE_EXHAUSTED from its length
    prefix, before the bytes are buffered or parsed. A front door with small requests sets it.
    """
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    if maximum_concurrent_rpcs is not None and maximum_concurrent_rpcs < 1:
        raise ValueError(f"maximum_concurrent_rpcs must be >= 1, got {maximum_concurrent_rpcs}")
    receive = MAX_MESSAGE_BYTES if max_receive_message_bytes is None else max_receive_message_bytes
    if not 1 <= receive <= MAX_MESSAGE_BYTES:
        raise ValueError(f"max_receive_message_bytes must be in [1, {MAX_MESSAGE_BYTES}], "
                         f"got {max_receive_message_bytes}")
    # gRPC sets SO_REUSEPORT by default, so a second server on a taken port would "bind" and
    # silently share its connections; turning it off makes the second one fail to start.
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", receive), ("grpc.so_reuseport", 0)]
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=options,
        maximum_concurrent_rpcs=maximum_concurrent_rpcs,
    )


class _Undecodable:
    """What a guarded deserializer returns for bytes that do not parse (never raised)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:  # the method takes raw bytes: nothing can fail to parse
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as e:
            return _Undecodable(str(e))

    return parse


def _guarded(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with a deserializer that cannot fail and a behaviour that answers bytes that
    did not parse with INVALID_ARGUMENT naming `method` ("/package.Service/Method")."""

    def refuse(bad: _Undecodable, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{method}: the request does not parse: {bad.reason}")

    if handler.request_streaming:
        name = "stream_stream" if handler.response_streaming else "stream_unary"
        behaviour = getattr(handler, name)

        def wrapped(requests, context, *rest):
            def checked():
                for r in requests:
                    if isinstance(r, _Undecodable):
                        refuse(r, context)
                    yield r
            return behaviour(checked(), context, *rest)
    else:
        name = "unary_stream" if handler.response_streaming else "unary_unary"
        behaviour = getattr(handler, name)

        def wrapped(request, context, *rest):
            if isinstance(request, _Undecodable):
                refuse(request, context)
            return behaviour(request, context, *rest)

    return handler._replace(request_deserializer=_tolerant(handler.request_deserializer),
                            **{name: wrapped})


class _GuardedGeneric(grpc.GenericRpcHandler):
    """A generic handler whose method handlers are `_guarded`; one wrap per method, kept."""

    def __init__(self, inner: grpc.GenericRpcHandler) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._cache: dict[str, grpc.RpcMethodHandler] = {}  # bounded: the service's methods

    def service(self, handler_call_details):
        method = handler_call_details.method
        with self._lock:
            cached = self._cache.get(method)
        if cached is not None:
            return cached
        handler = self._inner.service(handler_call_details)
        if handler is None:  # not one of the inner handler's methods: never cached
            return None
        handler = _guarded(method, handler)
        with self._lock:
            self._cache[method] = handler
        return handler


class _GuardingRegistrar:
    """Stands in for the server while a generated `add_*Servicer_to_server` registers."""

    def __init__(self, server: grpc.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GuardedGeneric(h) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self._server.add_registered_method_handlers(
            service, {m: _guarded(f"/{service}/{m}", h) for m, h in handlers.items()})


def add_servicer(server: grpc.Server, add_to_server: Callable[[Any, Any], None],
                 servicer: Any) -> None:
    """Registers `servicer` through its generated `add_to_server` (e.g.
    `api_pb2_grpc.add_GenerationServicer_to_server`) so that request bytes that do not parse
    get INVALID_ARGUMENT ("/pdserve.v1.Generation/Generate: the request does not parse: ...")
    instead of gRPC's INTERNAL "Exception deserializing request!"; the servicer never sees them.
    """
    add_to_server(servicer, _GuardingRegistrar(server))


def add_health_and_reflection(
    server: grpc.Server, service_full_names: Iterable[str]
) -> health.HealthServicer:
    """Registers grpc.health.v1 and reflection on `server`; marks every service SERVING.

    `service_full_names` are fully qualified, e.g. "pdserve.v1.KVStore". The overall status (the
    empty service name) is set SERVING too. The returned servicer lets the caller flip statuses,
    e.g. `enter_graceful_shutdown()` before stopping.
    """
    names = list(service_full_names)
    servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ["", *names]:
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return servicer


def make_channel(address: str) -> grpc.Channel:
    """An insecure channel to `address` ("host:port") with pdserve's message size limits."""
    return grpc.insecure_channel(address, options=_OPTIONS)


def make_aio_channel(address: str) -> grpc.aio.Channel:
    """As make_channel, for asyncio callers; create it inside the event loop that uses it."""
    return grpc.aio.insecure_channel(address, options=_OPTIONS)


def wait_healthy(address: str, timeout_s: float, service: str = "") -> None:
    """Polls the health service at `address` until `service` is SERVING.

    Raises TimeoutError naming the address (and the last status or error seen) after `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with make_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=service)
        while True:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise TimeoutError(
                    f"{address} not SERVING (service {service!r}) after {timeout_s}s: {last}"
                )
            try:
                response = stub.Check(request, timeout=min(remaining_s, 1.0))
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
            except grpc.RpcError as e:
                last = f"{e.code().name}: {e.details()}"
            # Short poll: a service usually comes up within a fraction of a second.
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


# Set once a stop signal arrives; per process, as signal handlers are.
_stop_requested = threading.Event()
_stop_signals: StopSignals | None = None


def catch_stop_signals() -> None:
    """Installs SIGTERM and SIGINT handlers that request a stop; idempotent, main thread only.

    Call it before announcing readiness: a signal sent right after a service reports ready would
    otherwise meet the default action and kill the process with no clean shutdown.
    """

    global _stop_signals
    if _stop_signals is None:  # idempotent: one relay thread per process
        _stop_signals = StopSignals(_stop_requested)


def wait_for_signal(poll_s: float = 0.5) -> int:
    """Blocks the main thread until SIGTERM or SIGINT; returns the signal number.

    Installs the handlers if catch_stop_signals() was not called yet (call it earlier, before
    announcing readiness, to close the window in which a signal would kill the process).
    """
    catch_stop_signals()  # idempotent
    # A timed wait keeps the main thread returning to the interpreter, where handlers run.
    while not _stop_requested.wait(poll_s):
        pass
    return _stop_signals.received[0]


def run_until_signal(server: grpc.Server, health: health.HealthServicer, address: str,
                     ready_line: Callable[[str], str], grace_s: float = 2.0) -> int:
    """Bind `address`, start, print the ready line, serve until SIGTERM/SIGINT, stop gracefully.

    Returns a process exit code: 1 if the address cannot be bound, else 0.
    """
    catch_stop_signals()
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        print(f"cannot bind {address}: {e}", file=sys.stderr, flush=True)
        return 1
    server.start()
    print(ready_line(f"{address.rsplit(':', 1)[0]}:{port}"), flush=True)
    wait_for_signal()
    health.enter_graceful_shutdown()
    server.stop(grace=grace_s).wait()
    return 0
