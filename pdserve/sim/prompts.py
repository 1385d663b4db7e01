"""A simulated request's prompt, synthesized from its trace entry: its token ids and the
chained hashes of its full blocks.

Owns `prompt_tokens_of` (token ids from the trace's prefix ids, as runs), `prompt_hashes_of`
(the full blocks' hashes derived from those ids, handed to the scheduler as known, so equal
prefixes name equal blocks with no token hashed) and `RequestPrompt`, one request's prompt
made from the trace when read and forgotten on request, so that a request queued behind many
others holds its index in the trace rather than its tokens and an object per block. Must not
know about workers, engines or routing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from hashlib import blake2b
from typing import Any

from pdserve.sim.tokens import RunTokens
from pdserve.sim.trace import HASH_BLOCK_TOKENS, SimRequest


def prompt_tokens_of(block_hashes: tuple[int, ...], prompt_tokens: int,
                     unique: int, seg: int = HASH_BLOCK_TOKENS) -> RunTokens:
    """Token ids of a prompt whose `seg`-token blocks carry `block_hashes` (token value: the
    block's id + 2; blocks past the ids get `-unique`, never shared), as runs (`RunTokens`:
    one per block, not a list of every token)."""
    values: list[int] = []
    ends: list[int] = []
    end = 0
    for h in block_hashes:
        if end >= prompt_tokens:
            break
        end = min(end + seg, prompt_tokens)
        values.append(h + 2)
        ends.append(end)
    if end < prompt_tokens:
        values.append(-unique)
        ends.append(prompt_tokens)
    return RunTokens.from_ends(values, ends)


def prompt_hashes_of(block_hashes: tuple[int, ...], prompt_tokens: int, unique: int,
                     block_size: int, seg: int = HASH_BLOCK_TOKENS) -> list[bytes]:
    """The chained hashes of the full `block_size`-token blocks of the prompt that
    `prompt_tokens_of` makes, derived from the trace's block ids without reading its tokens:
    each block is named by its runs of equal tokens (value x count) and its parent's hash. Two
    blocks get equal hashes exactly when their token ids and everything before them are equal,
    as with `hash_block`, whose names these never equal (a different encoding), so the
    scheduler can hash the blocks past them (decoded tokens) from token ids as usual."""
    n_ids = min(len(block_hashes), -(-prompt_tokens // seg))
    out: list[bytes] = []
    parent = b""
    for k in range(prompt_tokens // block_size):
        pos, hi = k * block_size, (k + 1) * block_size
        j = pos // seg
        if j >= n_ids or hi <= (j + 1) * seg:  # one run: the common case
            v = block_hashes[j] + 2 if j < n_ids else -unique
            parent = blake2b(parent + b"|runs:%dx%d" % (v, block_size), digest_size=16).digest()
            out.append(parent)
            continue
        runs: list[list[int]] = []
        while pos < hi:
            j = pos // seg
            v, end = (block_hashes[j] + 2, min(hi, (j + 1) * seg)) if j < n_ids else (-unique, hi)
            if runs and runs[-1][0] == v:
                runs[-1][1] += end - pos
            else:
                runs.append([v, end - pos])
            pos = end
        parent = blake2b(parent + b"|runs:" + ",".join(f"{v}x{c}" for v, c in runs).encode(),
                         digest_size=16).digest()
        out.append(parent)
    return out


class RequestPrompt:
    """Request `index` of `trace`'s prompt: `token_ids()` (`prompt_tokens_of`, made at each
    call) and its full blocks' chained hashes (`prompt_hashes_of`), read as the list they are
    (`len`, indexing, slices, iteration; made on first read and kept). `forget` drops the
    list, and the next read makes it again, the same hashes: a 12,000-token prompt has 750
    blocks of 16 tokens, an object and a pointer each. The request's unique id (for tokens
    past its prefix ids) is `index` + 1; each prefix id stands for `seg` tokens."""

    __slots__ = ("trace", "index", "tokens", "block_size", "seg", "made")

    def __init__(self, trace: Sequence[SimRequest], index: int, tokens: int,
                 block_size: int, seg: int = HASH_BLOCK_TOKENS) -> None:
        self.trace, self.index, self.tokens, self.block_size = trace, index, tokens, block_size
        self.seg = seg
        self.made: list[bytes] | None = None

    def token_ids(self) -> RunTokens:
        r = self.trace[self.index]
        return prompt_tokens_of(r.block_hashes, r.prompt_tokens, self.index + 1, self.seg)

    def hashes(self) -> list[bytes]:
        made = self.made
        if made is None:
            r = self.trace[self.index]
            made = self.made = prompt_hashes_of(r.block_hashes, r.prompt_tokens,
                                                self.index + 1, self.block_size, self.seg)
        return made

    def forget(self) -> None:
        self.made = None

    def __len__(self) -> int:
        return self.tokens // self.block_size

    def __getitem__(self, key: Any) -> Any:
        return self.hashes()[key]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.hashes())
