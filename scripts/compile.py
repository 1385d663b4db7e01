"""Compile `pdserve.compiled.MODULES` with mypyc into extension modules beside their sources.

Run by scripts/compile.sh (which installs mypy first). An editable install then imports the
extensions in place of the `.py` files; `--clean` removes them and Python runs the sources
again. The modules are type-checked first (mypy, imports outside the list followed silently);
a compiled module checks its annotations at run time, so a wrong one fails loudly here or there.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GROUP = "pdserve._compiled"  # the shared library: pdserve/_compiled__mypyc.*.so


def extensions() -> list[Path]:
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    return sorted(p for p in (ROOT / "pdserve").rglob("*") if p.name.endswith(suffixes))


def clean() -> None:
    for p in extensions():
        p.unlink()
        print(f"removed {p.relative_to(ROOT)}")
    shutil.rmtree(ROOT / "build" / "mypyc", ignore_errors=True)


def headers_missing() -> str | None:
    """Why an extension cannot be built with this interpreter, or None."""
    import sysconfig

    include = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(include, "Python.h")):
        v = f"{sys.version_info[0]}.{sys.version_info[1]}"
        return (f"no Python.h in {include}: the Python headers are needed "
                f"(Debian/Ubuntu: apt install python{v}-dev)")
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        return f"no C compiler ({cc}) on PATH"
    return None


def build(jobs: int) -> None:
    sys.path.insert(0, str(ROOT))
    from mypyc.build import mypycify
    from setuptools import Distribution

    from pdserve.compiled import MODULES

    clean()
    paths = [name.replace(".", "/") + ".py" for name in MODULES]
    flags = ["--follow-imports=silent", "--ignore-missing-imports",
             "--disable-error-code", "annotation-unchecked"]
    started = time.perf_counter()
    os.chdir(ROOT)
    print(f"compiling {len(paths)} modules with mypyc (about a minute on 2 cores) ...",
          flush=True)
    # A bare distribution: the project's own pyproject.toml is not read (its metadata is not
    # needed to build extensions in place).
    dist = Distribution({"name": "pdserve-compiled", "packages": [],
                         "ext_modules": mypycify(flags + paths, opt_level="3",
                                                 group_name=GROUP)})
    dist.script_args = ["build_ext", "--inplace", "--build-temp", "build/mypyc/temp",
                        "--build-lib", "build/mypyc/lib", "--parallel", str(jobs)]
    dist.parse_command_line()
    dist.run_commands()
    print(f"compiled {len(extensions())} extension modules in "
          f"{time.perf_counter() - started:.0f} s", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clean", action="store_true", help="remove the compiled modules")
    p.add_argument("--check", action="store_true",
                   help="only check that this interpreter can build extensions (exit 2 if not)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    if args.clean:
        clean()
        return 0
    why = headers_missing()
    if why is not None:
        print(f"scripts/compile.py: cannot compile: {why}", file=sys.stderr)
        return 2
    if args.check:
        return 0
    build(args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
