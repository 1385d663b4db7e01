"""Which modules can run compiled, and which do now.

Owns `MODULES`, the simulator's hot path (its event loop, workers, network and engine adapter)
and the torch-free cores it drives (the scheduler, block pool and sequence, the router's policy,
prefill deflection, membership, admission and KV index), which `scripts/compile.sh` compiles
with mypyc into extension modules beside their sources; and `compiled()`, the subset that
imports as an extension in this interpreter. The compiled modules are the same source, so they
make the same decisions (`.ci/compiled` checks a simulator report byte for byte against the
interpreted one) and Python runs the `.py` files wherever no extension was built.

Must not import the modules it names: it finds where their specs come from.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util

MODULES = (
    "pdserve.core.block_hash",
    "pdserve.core.rates",
    "pdserve.engine.block_pool",
    "pdserve.engine.scheduler",
    "pdserve.engine.sequence",
    "pdserve.router.admission",
    "pdserve.router.deflect",
    "pdserve.router.kv_index",
    "pdserve.router.local_prefill",
    "pdserve.router.membership",
    "pdserve.router.policy",
    "pdserve.sim.arrival",
    "pdserve.sim.cluster",
    "pdserve.sim.engine_model",
    "pdserve.sim.events",
    "pdserve.sim.flips",
    "pdserve.sim.host",
    "pdserve.sim.network",
    "pdserve.sim.prompts",
    "pdserve.sim.router",
    "pdserve.sim.tokens",
    "pdserve.sim.worker",
)


def compiled() -> list[str]:
    """The modules of `MODULES` that import from an extension module here."""
    out = []
    for name in MODULES:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if origin and origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
            out.append(name)
    return out
