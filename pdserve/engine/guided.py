"""Guided decoding: each structured request's grammar matcher, kept in step with its tokens, and
the masks the sampler applies.

Owns a request's `GuideState` (its matcher and the output tokens it has consumed) and the batch
of masks for one step: one row per sampled position, the rows of a speculating request masked
as if its drafts before them were emitted, so a draft the grammar forbids is never accepted and
the token drawn in its place is drawn inside the mask. The matcher follows the request's output
tokens whatever changed them: `sync` rolls back what was taken back (rejected drafts, drafts
decoded on anchor-precision KV) and consumes what is new (the prefill worker's first token
after a hand-over, a dead worker's tokens replayed on resume, a migrated request's tokens), so
no path needs to move a matcher's state: the tokens are the state. Must not sample.
"""

from __future__ import annotations

import threading
from typing import Callable

import llguidance
import torch

from pdserve.core.structured import Grammars, StructuredOutput

_BITS = None  # torch.arange(32), built on first use


class GuideState:
    """One request's matcher and the output tokens it has consumed."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.consumed: list[int] = []

    def sync(self, output_ids: list[int]) -> None:
        """Bring the matcher to the end of `output_ids`."""
        keep = len(self.consumed)
        if output_ids[:keep] != self.consumed:
            keep = 0
            while (keep < len(self.consumed) and keep < len(output_ids)
                   and self.consumed[keep] == output_ids[keep]):
                keep += 1
        back = len(self.consumed) - keep
        if back and not self.matcher.rollback(back):
            self.matcher.reset()
            keep = 0
        del self.consumed[keep:]
        new = output_ids[keep:]
        if new:
            # A token the grammar refuses leaves the matcher in its error state, where the
            # mask allows only the end of sequence (see `masks`).
            self.matcher.consume_tokens(list(new))
            self.consumed.extend(new)


class Guides:
    """The engine's grammars (built on the first structured request) and the step's masks."""

    def __init__(self, grammars: Callable[[], Grammars], eos_ids: list[int]) -> None:
        self._make_grammars = grammars
        self._grammars: Grammars | None = None
        self._lock = threading.Lock()
        self.eos_ids = list(eos_ids)
        self._executor: llguidance.LLExecutor | None = None

    @property
    def grammars(self) -> Grammars:
        with self._lock:
            if self._grammars is None:
                self._grammars = self._make_grammars()
            return self._grammars

    def warm(self) -> threading.Thread:
        """Build the grammars' vocabulary on a thread of its own now (a worker does, so that
        its first structured request does not stall the running batch for it)."""
        # Not a daemon: a worker stopped while the native tokenizer code still ran on this
        # thread crashed in the interpreter's teardown (SIGSEGV); exit waits the second out.
        t = threading.Thread(target=lambda: self.grammars, name="grammars-warm", daemon=False)
        t.start()
        return t

    def state(self, so: StructuredOutput) -> GuideState:
        return GuideState(self.grammars.matcher(so))

    def masks(self, entries: list[tuple[GuideState, list[int], int]], num_rows: int,
              vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For entries (state, drafts, first row): the rows [first, first + 1 + len(drafts))
        they mask. Returns (row indices, allowed [len(rows), vocab] bool)."""
        words = (vocab + 31) // 32
        bitmask = torch.full((num_rows, words), -1, dtype=torch.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=1)
        plain = [(st.matcher, first) for st, drafts, first in entries if not drafts]
        spec = [(st.matcher, first, list(drafts)) for st, drafts, first in entries if drafts]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), words * 4,
                                                   num_rows)
        if spec:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                spec, bitmask.data_ptr(), words * 4, num_rows)
        rows = [r for st, drafts, first in entries for r in range(first, first + 1 + len(drafts))]
        # A matcher in its error state allows nothing, and one whose grammar is complete only
        # the end of sequence (generated on under ignore_eos): both end the request.
        errored = [first for st, drafts, first in entries
                   if st.matcher.is_error() or st.matcher.is_stopped()]
        idx = torch.tensor(rows, dtype=torch.long)
        allowed = _unpack(bitmask[idx], vocab)
        if errored:
            pos = {r: k for k, r in enumerate(rows)}
            for r in errored:
                allowed[pos[r]] = False
                allowed[pos[r], self.eos_ids] = True
        return idx, allowed


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 bit words [n, W] -> bool [n, vocab] (bit b of word w is token 32 w + b)."""
    global _BITS
    if _BITS is None:
        _BITS = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
