"""A gRPC channel that follows certificates rotated on disk.

Owns `RotatingChannel`: a secure channel to one address whose next call after the process's
certificates change goes through a channel built with the new ones (calls in flight finish on
the old channel, which is dropped, not closed), so a long-lived channel (a router's to its
workers, a worker's to the store) reconnects with a certificate that is still valid. Stubs
keep working across the change: each multi-callable looks the current channel up when called.
Must not choose credentials: `pdserve.security.tls` builds them, `pdserve.rpc` asks for this.
"""

from __future__ import annotations

import threading

import grpc


class RotatingChannel(grpc.Channel):
    """A secure channel that moves to new credentials when the certificates change: the next
    call after a change goes through a channel built with them (calls in flight finish on the
    old one, which is dropped, not closed). Stubs keep working across the change: each
    multi-callable looks the current channel up when called."""

    def __init__(self, address: str, peer: str, sec, options: list) -> None:
        self._address, self._peer, self._sec, self._options = address, peer, sec, options
        self._lock = threading.Lock()
        self._generation = -1
        self._inner: grpc.Channel | None = None
        self._closed = False
        self.current()

    def current(self) -> grpc.Channel:
        generation = self._sec.generation()
        inner = self._inner
        if inner is not None and generation == self._generation:
            return inner
        with self._lock:
            if self._closed:
                raise ValueError("Cannot invoke RPC on closed channel!")
            if self._inner is None or generation != self._generation:
                creds, opts, generation = self._sec.channel_credentials(self._peer)
                self._inner = grpc.secure_channel(self._address, creds,
                                                  options=[*self._options, *opts])
                self._generation = generation
            return self._inner

    def _callable(self, kind: str, method: str, *args, **kwargs) -> "_RotatingCallable":
        return _RotatingCallable(self, kind, method, args, kwargs)

    def unary_unary(self, method, *args, **kwargs):
        return self._callable("unary_unary", method, *args, **kwargs)

    def unary_stream(self, method, *args, **kwargs):
        return self._callable("unary_stream", method, *args, **kwargs)

    def stream_unary(self, method, *args, **kwargs):
        return self._callable("stream_unary", method, *args, **kwargs)

    def stream_stream(self, method, *args, **kwargs):
        return self._callable("stream_stream", method, *args, **kwargs)

    def subscribe(self, callback, try_to_connect=False):
        self.current().subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback):
        if self._inner is not None:
            self._inner.unsubscribe(callback)

    def close(self):
        with self._lock:
            self._closed = True
            inner, self._inner = self._inner, None
        if inner is not None:
            inner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class _RotatingCallable:
    """A multi-callable bound to whichever channel is current when it is called."""

    __slots__ = ("_channel", "_kind", "_method", "_args", "_kwargs", "_generation", "_inner")

    def __init__(self, channel: RotatingChannel, kind: str, method: str, args, kwargs):
        self._channel, self._kind, self._method = channel, kind, method
        self._args, self._kwargs = args, kwargs
        self._generation = None
        self._inner = None

    def _current(self):
        inner = self._channel.current()
        if self._inner is None or self._generation is not inner:
            self._inner = getattr(inner, self._kind)(self._method, *self._args, **self._kwargs)
            self._generation = inner
        return self._inner

    def __call__(self, *args, **kwargs):
        return self._current()(*args, **kwargs)

    def __getattr__(self, name):  # with_call, future
        return getattr(self._current(), name)
