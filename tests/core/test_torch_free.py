"""The shared core, the router and the controller import in a fresh interpreter without torch:
the router's admission, the controller's pressures and a simulator can all use the core, and
the router serves without loading torch (its memory and start-up are a tokenizer's, not a
model runtime's)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.compiled import MODULES

_CORES = ["pdserve.core.rates", "pdserve.core.sampling_params",
          "pdserve.engine.checkpoint_config", "pdserve.core.stats", "pdserve.core.block_hash",
          "pdserve.core.finish", "pdserve.core.errors", "pdserve.core.draft_config",
          "pdserve.engine.scheduler", "pdserve.engine.sequence", "pdserve.engine.block_pool",
          "pdserve.engine.outputs", "pdserve.router.policy", "pdserve.router.admission",
          "pdserve.router.kv_index", "pdserve.router.membership", "pdserve.controller.policy",
          "pdserve.router.server", "pdserve.router.__main__", "pdserve.controller.server",
          # An emulated worker: the whole worker process, with the emulated engine.
          "pdserve.core.step_profile", "pdserve.engine.engine_core", "pdserve.engine.emulated",
          "pdserve.worker.server", "pdserve.worker.__main__"]


# Also every module scripts/compile.sh compiles: a compiled simulator must stay torch-free.
@pytest.mark.parametrize("module", sorted(set(_CORES) | set(MODULES)))
def test_imports_without_torch(module):
    code = (f"import sys, {module}; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
