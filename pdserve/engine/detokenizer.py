"""Streaming text out of a token stream: incremental detokenization and stop strings.

Owns turning one request's generated ids into text deltas that are final (never revised later)
and cutting the text at a stop string without ever having streamed part of one. Works on any
object with `decode(ids, skip_special_tokens=...)`; must not know about requests or sockets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# How many prompt tokens to decode as left context for the first generated token: enough for a
# decoder that treats a leading space specially (SentencePiece) to see it is mid-text.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text deltas for a growing id sequence, at O(1) tokens of decoding per new token.

    Keeps two offsets into the ids (the prefix/read offset technique of TGI and vLLM): the text
    already emitted ends at `read_offset`, and `ids[prefix_offset:read_offset]` is a short window
    decoded again as context, so each new delta is `decode(window + new) - decode(window)`. A delta
    ending in U+FFFD is an incomplete UTF-8 sequence (a byte-level token split a character) and is
    held back until a later token completes it; `flush()` gives whatever is held at the end.
    """

    def __init__(self, tokenizer: _Decoder, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids or ())
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - _PROMPT_CONTEXT_TOKENS)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)

    @property
    def pending_tokens(self) -> int:
        """Tokens received but not yet turned into emitted text."""
        return len(self._ids) - self._read_offset

    def push(self, new_ids: Sequence[int]) -> str:
        """Add generated ids; return the text they complete ("" while a character is partial)."""
        self._ids.extend(new_ids)
        text = self._decode(self._prefix_offset, len(self._ids))
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Emit whatever is held back (a trailing incomplete character decodes to U+FFFD)."""
        text = self._decode(self._prefix_offset, len(self._ids))
        if len(text) <= len(self._prefix_text):
            return ""
        return self._advance(text)

    def _advance(self, text: str) -> str:
        delta = text[len(self._prefix_text):]
        # The new window starts where the old read offset was: a point where text was complete.
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)


@dataclass(frozen=True)
class StopResult:
    """Outcome of checking the accumulated output text against the stop strings.

    `emit_until`: `text[:emit_until]` is final and safe to stream. When `stopped`, it is the index
    where the first stop string to complete begins (the output is truncated there, stop string
    excluded). The result does not depend on how the text was split into chunks.
    """

    stopped: bool
    emit_until: int
    stop_string: str | None = None


class StopChecker:
    """Finds stop strings in streamed text and says how much of the text is safe to emit.

    While streaming, a suffix of the text that is a prefix of some stop string may become a stop
    string once more tokens arrive, so it is held back: at most `max_holdback` (the longest stop
    string's length - 1) characters, and only as many as actually could start a stop string.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self.stop_strings = tuple(dict.fromkeys(stop_strings))
        self.max_holdback = max((len(s) for s in self.stop_strings), default=1) - 1

    def check(self, text: str, checked_until: int = 0) -> StopResult:
        """Check `text`; `checked_until` is how much a previous call saw without finding a stop.

        Only text from `checked_until - max_holdback` on is searched, so a stream costs O(new
        characters * stop strings) per call, not O(whole text); the holdback looks at the last
        `max_holdback` characters only.
        """
        start = max(0, checked_until - self.max_holdback)
        # Generation stops where the first stop string *completes* (smallest end; on a tie the
        # longer one, which starts earlier). Picking the smallest start instead would make the
        # output depend on how the text was chunked: with stops [" ", "a a"] and text "aa a",
        # " " completes first when streaming, though "a a" starts earlier.
        best: tuple[int, int, str] | None = None
        for s in self.stop_strings:
            i = text.find(s, start)
            if i != -1 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            return StopResult(stopped=True, emit_until=best[1], stop_string=best[2])
        return StopResult(stopped=False, emit_until=len(text) - self.holdback(text))

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string.

        Looks only at the last `max_holdback` characters, and per stop string only at the
        positions where its first character occurs there, so a call costs about the stop
        strings' total length, whatever the length of `text`.
        """
        tail = text[max(0, len(text) - self.max_holdback):] if self.max_holdback else ""
        longest = 0
        for s in self.stop_strings:
            # Candidates start where s[0] does, from the left: the first that fits is longest.
            start = len(tail) - min(len(s) - 1, len(tail))
            i = tail.find(s[0], start)
            while i != -1 and len(tail) - i > longest:
                if s.startswith(tail[i:]):
                    longest = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return longest
