"""The modules `scripts/compile.sh` compiles: sources that exist, import without torch (a
compiled build must not pull it into the simulator), and `compiled()` reports only those that
really load from an extension module. `.ci/compiled` builds them and checks the reports."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys
from pathlib import Path

import pdserve
from pdserve.compiled import MODULES, compiled

PACKAGE_DIR = Path(pdserve.__file__).parent


def test_every_listed_module_has_its_source_here():
    assert len(set(MODULES)) == len(MODULES)
    for name in MODULES:
        assert name.startswith("pdserve."), name
        source = PACKAGE_DIR / (name.split(".", 1)[1].replace(".", "/") + ".py")
        assert source.is_file(), f"{name}: no {source}"


def test_the_listed_modules_import_without_torch():
    code = ("import importlib, sys; from pdserve.compiled import MODULES; "
            "[importlib.import_module(m) for m in MODULES]; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_compiled_names_only_modules_loaded_from_an_extension():
    have = compiled()
    assert set(have) <= set(MODULES)
    for name in MODULES:
        origin = importlib.util.find_spec(name).origin
        is_extension = origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
        assert (name in have) == is_extension, (name, origin)
