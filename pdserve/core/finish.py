"""Why a request ended: the finish reasons the engine, the workers and the router share.

Owns the names: `STOP` (an end-of-sequence token, a stop token id or a stop string), `LENGTH`
(max_tokens or the context length reached), `ABORT` (cancelled, or lost past retries). They are
`str` values, so they compare equal to the plain strings the wire mapping and the OpenAI format
use ("stop", "length", "abort").
Must not import torch or any service; the protobuf mapping is `pdserve.wire`'s.
"""

from __future__ import annotations

import enum


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


STOP = FinishReason.STOP
LENGTH = FinishReason.LENGTH
ABORT = FinishReason.ABORT

# A request that ended this way produced its full output (an abort did not).
COMPLETED = frozenset({STOP, LENGTH})
