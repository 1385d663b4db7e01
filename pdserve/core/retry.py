"""A retry rule's answer: try again or not, after how long, and why.

Owns `RetryDecision`, what every pure retry rule returns: the router's for a hop a worker
refused (`router/retry.py`) and the store client's for a call no master answered
(`kvstore/retry.py`). Must not decide anything itself, nor import torch or any service.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RetryDecision:
    retry: bool
    delay_s: float  # wait this long before the next attempt (0 when not retrying)
    reason: str  # why, for logs and tests
