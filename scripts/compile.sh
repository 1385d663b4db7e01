#!/usr/bin/env bash
# Compiles the simulator's hot path and the torch-free cores it drives with mypyc (the list is
# pdserve/compiled.py), into extension modules beside their sources: `pdserve sim` and `pdserve
# bench sim` then run about 1.6x faster and decide exactly as before (the same source).
# Installs mypy into pdserve's interpreter first; needs gcc and an editable install
# (scripts/install.sh). `scripts/compile.sh --clean` goes back to the interpreted modules.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python.sh
if [ "${1:-}" != "--clean" ]; then
  "$PYTHON" scripts/compile.py --check  # the Python headers and gcc, before installing mypy
  # mypy pinned to the version the compiled build is tested with.
  "$PYTHON" -m pip install --disable-pip-version-check -q 'mypy==2.4.1' 'setuptools>=68'
fi
exec "$PYTHON" scripts/compile.py "$@"
