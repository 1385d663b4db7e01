"""The request id on every log line: a context variable, a logging filter and the format.

Owns `request_context(rid)` (set while a request's handler runs, on the thread that runs it) and
`configure(level)`, which every process's `__main__` calls so each line reads
`... [req=<id>] name: message` on every hop (router, prefill worker, decode worker share the id:
 the client's, and after a `~` the router's suffix that keeps it unique on the workers).
Must not log anything itself.
"""

from __future__ import annotations

import contextvars
import logging
from contextlib import contextmanager

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("pdserve_request_id", default="-")
FORMAT = "%(asctime)s %(levelname)s [req=%(request_id)s] %(name)s: %(message)s"


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = _request_id.get()
        return True


@contextmanager
def request_context(request_id: str):
    token = _request_id.set(request_id or "-")
    try:
        yield
    finally:
        _request_id.reset(token)


def current_request_id() -> str:
    return _request_id.get()


def configure(level: int = logging.INFO) -> None:
    """Root logging with the request id in every line (idempotent)."""
    logging.basicConfig(level=level, format=FORMAT)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RequestIdFilter) for f in handler.filters):
            handler.addFilter(RequestIdFilter())
