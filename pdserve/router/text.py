"""One request's output text: incremental detokenization plus stop strings, as final deltas.

Owns what text a client sees: every delta is final (never revised), and a stop string is never
partly streamed. Pure: ids in, text out.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.detokenizer import IncrementalDetokenizer, StopChecker


class OutputText:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stop = StopChecker(stop) if stop else None
        self.text = ""
        self._emitted = 0
        self._checked = 0
        self.stopped = False

    def push(self, ids: Sequence[int]) -> str:
        """Add generated ids; return the newly final text. Sets `stopped` on a stop string."""
        self.text += self._detok.push(ids)
        return self._emit(final=False)

    def finish(self) -> str:
        """The request ended: flush what was held back (unless a stop string cut it)."""
        if not self.stopped:
            self.text += self._detok.flush()
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        until = len(self.text)
        if self._stop is not None and not self.stopped:
            r = self._stop.check(self.text, self._checked)
            self._checked = len(self.text)
            if r.stopped:
                self.stopped = True
                self.text = self.text[: r.emit_until]
                until = r.emit_until
            elif not final:
                until = r.emit_until
        until = max(until, self._emitted)
        delta = self.text[self._emitted: until]
        self._emitted = until
        return delta
