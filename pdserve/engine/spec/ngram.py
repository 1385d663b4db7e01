"""The n-gram (prompt lookup) drafter: no model, only the request's own tokens.

For each request it takes the last n tokens (n from max_n down to min_n), finds their most
recent earlier occurrence in the prompt plus output, and proposes the tokens that followed it.
A match that overlaps the tail (a repeating pattern of period d) runs out of followers before k;
the proposal then continues the pattern (token m copies token m - d), as the text would if the
repetition went on.
Pure and deterministic; it must not keep state between calls or look at other requests.
"""

from __future__ import annotations

from pdserve.engine.spec.base import Draft, Drafter, DraftRequest


def ngram_lookup(history: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of history's last n tokens."""
    if k <= 0:
        return []
    size = len(history)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = history[size - n:]
        first = tail[0]
        # Start positions i < size - n (an earlier occurrence), most recent first.
        for i in range(size - n - 1, -1, -1):
            if history[i] == first and history[i:i + n] == tail:
                out = list(history[i + n:i + n + k])
                period = size - n - i
                while len(out) < k:
                    out.append(out[len(out) - period])
                return out
    return []


class NgramDrafter(Drafter):
    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(ngram_lookup(r.token_ids, r.k, self.min_n, self.max_n)) for r in requests]
