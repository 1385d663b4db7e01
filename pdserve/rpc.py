"""Small gRPC helpers shared by every pdserve service and client.

Owns the server and channel options (message size limits), the three kinds of listener and the
channels to them (internal: mutual TLS with the cluster's certificates; control: TLS, each call
authenticated; public: the client APIs, plaintext or the operator's TLS), registering a
servicer so that every call passes its listener's `Guard` before the handler runs and bytes
that do not parse as its request get INVALID_ARGUMENT naming the method (gRPC's own answer is
INTERNAL), standard health checking and server reflection (and a plaintext port serving health
alone, for probes that cannot speak TLS), waiting for a service to become healthy, and a
service process's wait for SIGTERM.
Must not know any pdserve service or decide who may call: it takes service names as strings,
never imports stubs, and asks `pdserve.security` for credentials and verdicts.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.channel import RotatingChannel
from pdserve.lifecycle import StopSignals
from pdserve.rpc_bound import BoundedPool, refuse_if_busy
from pdserve.security import tls as security
from pdserve.security.guard import CONTROL, INTERNAL, Guard

log = logging.getLogger(__name__)

__all__ = ["CONTROL", "INTERNAL", "PUBLIC", "Guard", "PublicTls", "add_health_and_reflection",
           "add_servicer", "bind", "bind_public", "caller", "make_aio_channel", "make_channel",
           "make_public_aio_channel", "make_public_channel", "make_server", "run_until_signal",
           "serve_health", "wait_healthy"]

PUBLIC = "public"  # a channel's peer: the router's client APIs
ANY = security.ANY  # a channel's peer: any server of the cluster (health probes)
# Who the call being handled came from ("key:NAME", "cert:KIND/NAME"), for audit lines.
_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("pdserve_caller", default="")

# KV blocks of a long prompt run to tens of MiB per message in the first (copying) store
# transport; gRPC's 4 MiB default would reject them. 256 MiB bounds one message (invariant 5).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A peer that restarts (a supervised router, master or worker comes back in about a
    # second) is found again within a second: gRPC's default backoff waits 1 s, then 1.6 s,
    # 2.6 s, ... between attempts, so a client would see a healed server as down for longer
    # than it was.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def make_server(max_workers: int, maximum_concurrent_rpcs: int | None = None,
                max_receive_message_bytes: int | None = None,
                on_busy: Callable[[], None] = lambda: None,
                share_port: bool = False) -> grpc.Server:
    """A thread-pool gRPC server with pdserve's message size limits; not yet bound or started.

    `maximum_concurrent_rpcs` bounds RPCs in progress (queued for a thread or running); past it
    a call is answered RESOURCE_EXHAUSTED at once, with a `retry-after` trailer, instead of
    queueing without limit (and `on_busy` is called). None: no bound.
    `share_port`: its ports bound with SO_REUSEPORT, so servers of several processes on one
    host serve one port (the kernel spreads connections among them); off, a second server on
    a taken port fails to start.
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
               ("grpc.max_receive_message_length", receive),
               ("grpc.so_reuseport", 1 if share_port else 0)]
    pool = (futures.ThreadPoolExecutor(max_workers=max_workers)
            if maximum_concurrent_rpcs is None else
            BoundedPool(max_workers, maximum_concurrent_rpcs, on_busy))
    return grpc.server(pool, options=options)


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


def caller() -> str:
    """Who made the call this handler serves ("key:NAME" or "cert:KIND/NAME"; "" when nothing
    was proven, as with --insecure-internal)."""
    return _CALLER.get()


def _guarded(method: str, handler: grpc.RpcMethodHandler,
             guard: Guard | None) -> grpc.RpcMethodHandler:
    """`handler` behind `guard` (a refused call never reaches it: UNAUTHENTICATED or
    PERMISSION_DENIED with the reason), with a deserializer that cannot fail and a behaviour
    that answers bytes that did not parse with INVALID_ARGUMENT naming `method`
    ("/package.Service/Method")."""

    def refuse(bad: _Undecodable, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{method}: the request does not parse: {bad.reason}")

    def admit(context: grpc.ServicerContext) -> contextvars.Token | None:
        refuse_if_busy(method, context)
        if guard is None:
            return None
        verdict = guard.check(method, context)
        if verdict.refused:
            context.abort(getattr(grpc.StatusCode, verdict.code), verdict.message)
        return _CALLER.set(verdict.who)

    def leave(token: contextvars.Token | None) -> None:
        if token is not None:
            _CALLER.reset(token)

    if handler.request_streaming:
        name = "stream_stream" if handler.response_streaming else "stream_unary"
        behaviour = getattr(handler, name)

        def wrapped(requests, context, *rest):
            def checked():
                for r in requests:
                    if isinstance(r, _Undecodable):
                        refuse(r, context)
                    yield r
            token = admit(context)
            try:
                return behaviour(checked(), context, *rest)
            finally:
                leave(token)
    else:
        name = "unary_stream" if handler.response_streaming else "unary_unary"
        behaviour = getattr(handler, name)

        def wrapped(request, context, *rest):
            token = admit(context)
            try:
                if isinstance(request, _Undecodable):
                    refuse(request, context)
                return behaviour(request, context, *rest)
            finally:
                leave(token)

    return handler._replace(request_deserializer=_tolerant(handler.request_deserializer),
                            **{name: wrapped})


class _GuardedGeneric(grpc.GenericRpcHandler):
    """A generic handler whose method handlers are `_guarded`; one wrap per method, kept."""

    def __init__(self, inner: grpc.GenericRpcHandler, guard: Guard | None) -> None:
        self._inner = inner
        self._guard = guard
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
        handler = _guarded(method, handler, self._guard)
        with self._lock:
            self._cache[method] = handler
        return handler


class _GuardingRegistrar:
    """Stands in for the server while a generated `add_*Servicer_to_server` registers."""

    def __init__(self, server: grpc.Server, guard: Guard | None) -> None:
        self._server = server
        self._guard = guard

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers(
            tuple(_GuardedGeneric(h, self._guard) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self._server.add_registered_method_handlers(
            service, {m: _guarded(f"/{service}/{m}", h, self._guard)
                      for m, h in handlers.items()})


_NO_GUARD = object()


def add_servicer(server: grpc.Server, add_to_server: Callable[[Any, Any], None],
                 servicer: Any, guard: Guard | None | object = _NO_GUARD) -> None:
    """Registers `servicer` through its generated `add_to_server` (e.g.
    `api_pb2_grpc.add_GenerationServicer_to_server`) behind `guard`: a cluster-internal
    service names its listener's `Guard`; only a public client API passes None (its own
    handler checks API keys). Request bytes that do not parse get INVALID_ARGUMENT
    ("/pdserve.v1.Generation/Generate: the request does not parse: ...") instead of gRPC's
    INTERNAL "Exception deserializing request!"; the servicer never sees them.
    """
    if guard is _NO_GUARD:
        raise TypeError("add_servicer: say which Guard checks the calls (None: a public API)")
    add_to_server(servicer, _GuardingRegistrar(server, guard))  # type: ignore[arg-type]


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


@dataclass(frozen=True)
class PublicTls:
    """TLS of the client APIs (`--tls-cert`, `--tls-key`, and `--tls-client-ca` to require
    client certificates from that CA): files, re-read on change as the internal ones are."""

    cert_path: str
    key_path: str
    client_ca_path: str = ""

    def server_credentials(self) -> grpc.ServerCredentials:
        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        def load():
            ca = read(self.client_ca_path) if self.client_ca_path else None
            return grpc.ssl_server_certificate_configuration(
                [(read(self.key_path), read(self.cert_path))], root_certificates=ca)

        paths = [p for p in (self.cert_path, self.key_path, self.client_ca_path) if p]
        stamp = lambda: tuple(security.file_stamp(p) for p in paths)  # noqa: E731
        seen = [stamp()]

        def fetch():
            try:
                now = stamp()
                if now == seen[0]:
                    return None
                config = load()
            except (OSError, ValueError):
                return None  # mid-rotation: keep serving the last good pair
            seen[0] = now
            return config

        return grpc.dynamic_ssl_server_credentials(
            load(), fetch, require_client_authentication=bool(self.client_ca_path))


# A channel with a connection of its own: gRPC otherwise shares one among a process's
# channels to the same address, so clients meant as separate ones (each spread by the kernel
# over routers sharing a port) would all land on one router.
_OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def make_public_channel(address: str, root_pem: bytes | None = None,
                        server_name: str | None = None, own_connection: bool = False
                        ) -> grpc.Channel:
    """A channel to the router's client APIs: plaintext, or TLS trusting `root_pem` (the
    system's roots when b"") checked against `server_name` (default: the address's host);
    `own_connection`: not shared with the process's other channels to that address."""
    own = _OWN_CONNECTION if own_connection else []
    if root_pem is None:
        return grpc.insecure_channel(address, options=[*_OPTIONS, *own])
    options = list(_OPTIONS) + own + ([("grpc.ssl_target_name_override", server_name)]
                                      if server_name else [])
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_pem or None),
                               options=options)


def make_public_aio_channel(address: str, own_connection: bool = False) -> grpc.aio.Channel:
    """As make_public_channel (plaintext), for asyncio callers; create it inside the event
    loop that uses it."""
    return grpc.aio.insecure_channel(
        address, options=[*_OPTIONS, *(_OWN_CONNECTION if own_connection else [])])


def make_channel(address: str, peer: str, options: Iterable[tuple[str, Any]] = (),
                 security_: security.Security | None = None) -> grpc.Channel:
    """A channel to a cluster-internal server of kind `peer` ("worker", "master", ...; ANY
    when any cluster server will do, PUBLIC for the client APIs) at `address`, as this
    process's internal TLS says (`pdserve.security.tls.current()`, or `security_`): mutual
    TLS, the server's certificate checked to be `peer`'s whatever the address, and rebuilt
    when the certificates on disk change; or plaintext with --insecure-internal."""
    if peer == PUBLIC:
        return make_public_channel(address)
    opts = [*_OPTIONS, *options]
    sec = security_ or security.current()
    if sec.insecure:
        return grpc.insecure_channel(address, options=opts)
    return RotatingChannel(address, peer, sec, opts)


def make_aio_channel(address: str, peer: str) -> grpc.aio.Channel:
    """As make_channel, for asyncio callers (create it inside the event loop that uses it):
    with the certificates on disk now; a caller that reconnects makes a new one, so a rotation
    takes effect at its next connection."""
    sec = security.current()
    if sec.insecure:
        return grpc.aio.insecure_channel(address, options=_OPTIONS)
    creds, options, _ = sec.channel_credentials(peer)
    return grpc.aio.secure_channel(address, creds, options=[*_OPTIONS, *options])


def bind(server: grpc.Server, address: str, kind: str, plane: str = INTERNAL) -> int:
    """Listen on `address` as a server of `kind`: INTERNAL requires a cluster certificate of
    every client; CONTROL takes TLS without one (its Guard authenticates each call); both
    plaintext with --insecure-internal. The port bound; RuntimeError if it cannot be."""
    sec = security.current()
    if sec.insecure:
        return server.add_insecure_port(address)
    return server.add_secure_port(
        address, sec.server_credentials(kind, require_client_cert=plane == INTERNAL))


def bind_public(server: grpc.Server, address: str, public_tls: PublicTls | None) -> int:
    """Listen on `address` for the client APIs: plaintext, or TLS with the operator's files."""
    if public_tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, public_tls.server_credentials())


def serve_health(health_servicer: health.HealthServicer, address: str
                 ) -> tuple[grpc.Server, int]:
    """A plaintext listener at `address` serving only `grpc.health.v1` from `health_servicer`
    (a Kubernetes gRPC probe speaks no TLS; health says SERVING or not, nothing else), started.
    (server, port); RuntimeError if the address cannot be bound."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[
        ("grpc.so_reuseport", 0)], maximum_concurrent_rpcs=16)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(address)
    server.start()
    return server, port


def wait_healthy(address: str, timeout_s: float, service: str = "", peer: str = ANY,
                 security_: security.Security | None = None) -> None:
    """Polls the health service at `address` (a server of kind `peer`; PUBLIC: the client
    APIs in plaintext) until `service` is SERVING (as `security_`, default this process's
    setting).

    Raises TimeoutError naming the address (and the last status or error seen) after `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with make_channel(address, peer, security_=security_) as channel:
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
    signum = _stop_signals.first
    assert signum is not None  # the event is set only once a signal is recorded
    return signum


def run_until_signal(server: grpc.Server, health: health.HealthServicer, address: str,
                     ready_line: Callable[[str], str], kind: str, grace_s: float = 2.0,
                     plane: str = INTERNAL, health_address: str | None = None,
                     on_stop: Callable[[], Any] = lambda: None) -> int:
    """Bind `address` as a server of `kind` (`bind`), and `health_address` for plaintext
    probes when given; start, print the ready line, serve until SIGTERM/SIGINT, stop
    gracefully: health says NOT_SERVING, `on_stop` runs, then calls get `grace_s` to end.

    Returns a process exit code: 1 if an address cannot be bound, else 0.
    """
    catch_stop_signals()
    try:
        port = bind(server, address, kind, plane)
        probe = serve_health(health, health_address)[0] if health_address else None
    except RuntimeError as e:
        print(f"cannot bind {address}: {e}", file=sys.stderr, flush=True)
        return 1
    server.start()
    print(ready_line(f"{address.rsplit(':', 1)[0]}:{port}"), flush=True)
    wait_for_signal()
    health.enter_graceful_shutdown()
    try:
        on_stop()
    except Exception:
        log.exception("stopping: the server stops anyway")
    server.stop(grace=grace_s).wait()
    if probe is not None:
        probe.stop(grace=None)
    return 0
