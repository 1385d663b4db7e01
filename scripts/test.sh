#!/usr/bin/env bash
# Install pdserve with its test dependencies and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
PYTHON=${PYTHON:-python3}
exec "$PYTHON" -m pytest -q "$@"
