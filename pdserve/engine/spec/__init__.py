"""Speculative decoding: drafters that propose tokens, and the rule that verifies them.

Owns the drafter interface (`Drafter`), the drafters (`NgramDrafter` so far), greedy
verification (`verify_greedy`) and the acceptance counters (`SpecStats`). It must not schedule,
touch the KV cache or run the target model: the model runner feeds drafts through its step and
hands the target's argmaxes back here. See `pdserve.engine.model_runner` for how a step verifies.
"""

from pdserve.engine.spec.base import (Draft, Drafter, DraftRequest, SpecStats, make_drafter,
                                      verify_greedy)
from pdserve.engine.spec.ngram import NgramDrafter

__all__ = ["Draft", "DraftRequest", "Drafter", "NgramDrafter", "SpecStats", "make_drafter", "verify_greedy"]
