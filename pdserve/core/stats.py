"""Summary statistics the controller's signals and the benchmarks share.

Owns the percentile rule (linear interpolation between closest ranks, numpy's default), so an
SLO attainment the controller steers by and a p90 a benchmark reports mean the same thing.
Must not import torch or any service.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (q in [0, 100]) with linear interpolation between closest ranks
    (numpy's default), or None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
