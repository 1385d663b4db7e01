"""The router's HTTP server: uvicorn on a thread of its own, its connections bounded.

Owns serving an ASGI app (the OpenAI API) next to the gRPC server: binding (a clear error when
the address is taken), HTTPS with certificate files followed as they change, and the bound on
connections held at once, answered as admission answers: a connection past it has its request
answered 429 with `Retry-After` and an OpenAI error body, then closed (uvicorn's own bound
answers a bare 503, which a client cannot tell from a broken server). One HTTP/1.1 connection
carries one request at a time, so the bound on connections bounds the requests in the app too.
Must not know the API's routes or admission's arithmetic.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
import time
from typing import Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
REFUSAL_RETRY_AFTER_S = 1  # a refused connection's hint: connections free as streams end


class HttpStartError(RuntimeError):
    """The HTTP server could not bind its address or did not start."""


def open_files_for(connections: int) -> int:
    """Raise this process's open-file limit to hold `connections` sockets and some to spare
    (the soft limit, up to the hard one: a stock 1,024 would make accepts fail, and clients
    wait unanswered); the limit now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + _SPARE_FILES
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


_SPARE_FILES = 1024  # beside the HTTP connections: gRPC channels to workers, files, the store


def refusal(limit: int) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The headers and body of the 429 a connection past `limit` gets (OpenAI's error shape,
    as admission's refusals)."""
    body = json.dumps({"error": {
        "message": (f"too many connections: this router serves {limit} at once; retry after "
                    f"{REFUSAL_RETRY_AFTER_S}s"),
        "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}}).encode()
    return [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
            (b"retry-after", b"%d" % REFUSAL_RETRY_AFTER_S), (b"connection", b"close")], body


def bounded_protocol(limit: int, on_refused: Callable[[], None]) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol, a connection past `limit` open ones answered with
    `refusal(limit)` whatever it asks (its request is read first, so the client gets the answer
    rather than a reset)."""
    if limit < 1:
        raise ValueError(f"max_connections must be >= 1, got {limit}")
    headers, body = refusal(limit)

    async def refuse(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 429, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    class Bounded(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limit:
                self.app = refuse
                on_refused()

    return Bounded


class HttpServer:
    """uvicorn serving an ASGI app on its own thread and event loop, next to the gRPC server."""

    def __init__(self, app, host: str, port: int, *, max_connections: int = 1024,
                 graceful_s: int = 2, tls=None,
                 on_refused: Callable[[], None] = lambda: None, share_port: bool = False
                 ) -> None:
        """`tls`: a `rpc.PublicTls` to serve HTTPS with (its files re-read when they change;
        a client CA makes client certificates required), or None for plain HTTP.
        `max_connections`: connections served at once; one past it has its request answered
        429 (`bounded_protocol`), and `on_refused` is called. `share_port`: bound with
        SO_REUSEPORT (several routers of one host on one port)."""
        self.host = host
        self.port = port
        self.share_port = share_port
        files = open_files_for(max_connections)
        if files < max_connections + _SPARE_FILES:
            log.warning("open-file limit %d is below %d HTTP connections + %d: raise it "
                        "(ulimit -n) or lower --http-max-connections", files, max_connections,
                        _SPARE_FILES)
        ssl_args = {} if tls is None else dict(
            ssl_certfile=tls.cert_path, ssl_keyfile=tls.key_path,
            ssl_ca_certs=tls.client_ca_path or None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls.client_ca_path else ssl.CERT_NONE)
        # uvicorn's own bound (limit_concurrency) answers a bare 503: left off, ours answers.
        self._config = uvicorn.Config(app, http=bounded_protocol(max_connections, on_refused),
                                      loop="asyncio", lifespan="on",
                                      log_config=None, access_log=False,
                                      timeout_graceful_shutdown=graceful_s, **ssl_args)
        if tls is not None:
            from uvicorn.config import create_ssl_context

            from pdserve.security.tls import follow_files

            self._config.load()
            build = lambda: create_ssl_context(  # noqa: E731
                self._config.ssl_certfile, self._config.ssl_keyfile, None,
                self._config.ssl_version, self._config.ssl_cert_reqs, self._config.ssl_ca_certs,
                self._config.ssl_ciphers)
            follow_files(self._config.ssl, build,
                         [p for p in (tls.cert_path, tls.key_path, tls.client_ca_path) if p])
        self._server = uvicorn.Server(self._config)
        self._thread: threading.Thread | None = None
        self.address = ""

    def start(self, timeout_s: float = 30.0) -> str:
        """Bind, start serving, return the bound "host:port" (port 0 picks a free one)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self.share_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise HttpStartError(f"cannot bind http {self.host}:{self.port}: {e}") from None
        host = f"[{self.host}]" if family == socket.AF_INET6 else self.host
        self.address = f"{host}:{sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise HttpStartError(f"http server on {self.address} did not start")
            time.sleep(0.01)
        return self.address

    def stop(self, timeout_s: float = 5.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
