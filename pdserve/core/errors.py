"""The one configuration error every service raises.

Owns `ConfigError`: a configuration value (a flag, a config file field, a benchmark setting) is
invalid, and the message names the field. Every service's `config.py` and every benchmark raise
this type (or a subclass), so a command line prints one kind of error the same way and a caller
catches one type. It is a `ValueError`, as the per-service classes it replaces were.
Must not import torch or any service.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""
