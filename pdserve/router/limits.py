"""Size bounds on one request, the same for the gRPC and the HTTP API (invariants 5 and 7).

Owns the numbers and the arithmetic that refuses a request from its sizes alone, before any
tokenization or template rendering: the largest request message, how many stop strings and how
long, how many stop token ids, how long an id or a salt may be, and how many bytes of prompt
text could ever fit the context. Pure: no I/O, no gRPC or HTTP, no tokenizer.
Must not tokenize: a bound here is worth having only while it is cheaper than the work it spares.
"""

from __future__ import annotations

# As OpenAI's API: at most this many stop strings; each at most this many UTF-8 bytes. The stop
# check holds back and rescans at most the longest stop string per delta, so these bound its cost.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_BYTES = 256
# Stop token ids are scanned on the worker at every step of the request.
MAX_STOP_TOKEN_IDS = 256
# A client's request id goes on every log line of every hop and back in every message.
MAX_REQUEST_ID_CHARS = 256
# A cache salt becomes part of the request's tenant name (admission, metrics, logs).
MAX_CACHE_SALT_BYTES = 256
# Values quoted back in error messages are cut to this many characters, and messages that may
# quote a request (a chat template's own error) to MAX_MESSAGE_CHARS: a status message travels
# in a gRPC trailer, whose size the client bounds (8 KiB of metadata by default).
MAX_QUOTED_CHARS = 64
MAX_MESSAGE_CHARS = 1024
# An HTTP body of B bytes becomes a GenerateRequest of at most B plus this (a generated request
# id, a default temperature and max_tokens): JSON spells every field at least as long as protobuf.
REQUEST_ENVELOPE_BYTES = 4096


def grpc_receive_bytes(http_max_body_bytes: int) -> int:
    """The router's gRPC receive bound: the HTTP body bound plus the envelope, so one value bounds
    both APIs and every HTTP request that passes its bound also passes gRPC's."""
    return http_max_body_bytes + REQUEST_ENVELOPE_BYTES


def max_prompt_bytes(max_model_len: int, max_token_bytes: int) -> int:
    """The most UTF-8 bytes of text that can encode to a prompt fitting `max_model_len`.

    A prompt must leave room for one generated token: at most `max_model_len - 1` tokens. Every
    byte of the text belongs to exactly one token and no token spells more than
    `max_token_bytes` bytes (the vocabulary's longest token, the bytes-per-token ceiling), so a
    text longer than their product encodes to too many tokens whatever its content. Exact for
    byte-level BPE without a normalizer (every model served here) on text its vocabulary can
    spell; a tokenizer drops what it cannot spell (SmolLM2: six ASCII control bytes) and a
    normalizer may delete text, so a longer text padded with such characters could fit: it is
    refused, as the garbage it is.
    """
    return max(0, max_model_len - 1) * max(1, max_token_bytes)


def quoted(value: str) -> str:
    """`value` as an error message quotes it: repr, cut to MAX_QUOTED_CHARS characters."""
    if len(value) <= MAX_QUOTED_CHARS:
        return repr(value)
    return f"{value[:MAX_QUOTED_CHARS]!r}... ({len(value)} characters)"


def cut(message: str) -> str:
    """`message` cut to MAX_MESSAGE_CHARS characters."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}... ({len(message)} characters)"
