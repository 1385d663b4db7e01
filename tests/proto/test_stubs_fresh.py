"""The committed stubs in pdserve/proto/ equal a fresh generation from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO_ROOT

PROTO_DIR = REPO_ROOT / "pdserve" / "proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _generated_names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    protos = sorted(p.relative_to(REPO_ROOT).as_posix() for p in PROTO_DIR.glob("*.proto"))
    assert protos, f"no .proto files in {PROTO_DIR}"
    # Same invocation as scripts/gen_proto.sh, only writing into tmp_path.
    result = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", ".", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *protos],
        cwd=REPO_ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 0, f"protoc failed:\n{result.stderr}"
    fresh_dir = tmp_path / "pdserve" / "proto"
    fresh, committed = _generated_names(fresh_dir), _generated_names(PROTO_DIR)
    problems = [f"{PROTO_DIR / n} is missing" for n in sorted(fresh - committed)]
    problems += [f"{PROTO_DIR / n} has no .proto behind it" for n in sorted(committed - fresh)]
    problems += [
        f"{PROTO_DIR / n} differs from a fresh generation"
        for n in sorted(fresh & committed)
        if (fresh_dir / n).read_bytes() != (PROTO_DIR / n).read_bytes()
    ]
    assert not problems, "stale generated stubs; run scripts/gen_proto.sh:\n" + "\n".join(problems)
