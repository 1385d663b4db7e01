"""The system's shared error types: the one configuration error every service raises, and the
errors its torch-free cores raise to their callers.

Owns `ConfigError`: a configuration value (a flag, a config file field, a benchmark setting) is
invalid, and the message names the field. Every service's `config.py` and every benchmark raise
this type (or a subclass), so a command line prints one kind of error the same way and a caller
catches one type. It is a `ValueError`, as the per-service classes it replaces were.
`InvalidArgumentError`: a request field is invalid (INVALID_ARGUMENT / HTTP 400, naming it).
The cores' errors live here too (`NoFreeBlocksError`, `QueueFullError`, `NoWorkerError`,
`UnknownMemberError`; each core module re-exports its own), so the cores can be compiled
(`scripts/compile.sh`) without subclassing a builtin exception in a compiled module.
Must not import torch or any service.
"""

from __future__ import annotations


class InvalidArgumentError(ValueError):
    """A request field is invalid. `field` names it (mapped to INVALID_ARGUMENT / HTTP 400)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


class NoFreeBlocksError(RuntimeError):
    """The block pool has fewer free blocks than asked for (the scheduler checks first)."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound (mapped to RESOURCE_EXHAUSTED / HTTP 429)."""


class NoWorkerError(RuntimeError):
    """No healthy worker of the needed role (mapped to UNAVAILABLE)."""


class UnknownMemberError(KeyError):
    """An address the router does not know (mapped to NOT_FOUND by the control API)."""

    def __str__(self) -> str:  # KeyError's own str() quotes the message
        return str(self.args[0]) if self.args else "unknown worker"
