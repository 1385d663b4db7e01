"""The package's import contracts (`.importlinter`) hold: the layers from the CLI down to core,
the worker's own layers, no cycles between packages, and no torch in the torch-free cores, the
router, the controller and the simulator. A failure prints import-linter's report, which names
each import that breaks a contract and the chain it comes through."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept():
    out = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                               "lint_imports_command()", "--no-cache"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"lint-imports failed:\n{out.stdout}\n{out.stderr}"
    assert "0 broken" in out.stdout, out.stdout
