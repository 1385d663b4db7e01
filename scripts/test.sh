#!/usr/bin/env bash
# Install pdserve with its test dependencies and run the whole test suite (with the interpreter
# install.sh installed into: ./.venv on a PEP 668 Python, see scripts/python.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
. scripts/python.sh
exec "$PYTHON" -m pytest -q "$@"
