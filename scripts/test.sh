#!/usr/bin/env bash
# Install pdserve with its test dependencies and run the test suite (with the interpreter
# install.sh installed into: ./.venv on a PEP 668 Python, see scripts/python.sh). The long
# end-to-end scenarios (marker `scenario`) are left out; `bash scripts/test.sh -m scenario` runs
# them (CI: .ci/scenarios), and a later -m replaces this one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
. scripts/python.sh
exec "$PYTHON" -m pytest -q -m "not scenario" "$@"
