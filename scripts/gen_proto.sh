#!/usr/bin/env bash
# Regenerates the Python stubs in pdserve/proto/ from the .proto files there.
# Run from anywhere; commit the results. tests/proto/test_stubs_fresh.py fails when they are stale.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
# Check for the generator before deleting anything, so a wrong interpreter leaves the stubs be.
if ! "$PYTHON" -c "import grpc_tools.protoc" 2>/dev/null; then
  echo "gen_proto.sh: $PYTHON has no grpc_tools; set PYTHON to the project's venv python" >&2
  exit 1
fi
# Remove old stubs first so a deleted .proto leaves no orphan module behind.
rm -f pdserve/proto/*_pb2.py pdserve/proto/*_pb2.pyi pdserve/proto/*_pb2_grpc.py
# -I . makes generated imports read `from pdserve.proto import common_pb2`.
"$PYTHON" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. pdserve/proto/*.proto
echo "regenerated: $(ls pdserve/proto/*_pb2*.py* | tr '\n' ' ')"
