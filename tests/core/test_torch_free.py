"""The shared core imports in a fresh interpreter without torch: the router's admission, the
controller's pressures and a simulator can all use it."""

from __future__ import annotations

import subprocess
import sys


def test_core_imports_without_torch():
    code = ("import sys, pdserve.core.rates; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
