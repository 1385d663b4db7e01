"""`pdserve <process>`: each process of a cluster starts from the one command, with flags or
`PDSERVE_<KIND>_<FLAG>` environment variables (the form a container spec uses)."""

from __future__ import annotations

import subprocess
import sys

from pdserve.entrypoints import PROCESSES, env_flags
from tests.helpers import free_port, start_process, stop_process


def test_env_flags_map_variables_of_one_kind_to_flags_in_name_order():
    env = {"PDSERVE_ROUTER_MAX_IN_FLIGHT": "64", "PDSERVE_ROUTER_ADDRESS": "0.0.0.0:1",
           "PDSERVE_WORKER_ROLE": "decode", "PDSERVE_ROUTER_": "x", "HOME": "/root"}
    assert env_flags("router", env) == ["--address", "0.0.0.0:1", "--max-in-flight", "64"]
    assert env_flags("worker", env) == ["--role", "decode"]
    assert env_flags("master", env) == []


def test_every_process_kind_answers_help_from_the_pdserve_command():
    for kind in PROCESSES:
        out = subprocess.run([sys.executable, "-m", "pdserve.cli", kind, "--help"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (kind, out.stderr)
        assert "--address" in out.stdout or "--master" in out.stdout, (kind, out.stdout)


def test_a_master_started_from_environment_variables_serves_at_their_address(monkeypatch,
                                                                              tmp_path):
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("PDSERVE_MASTER_ADDRESS", address)
    monkeypatch.setenv("PDSERVE_MASTER_JOURNAL_DIR", str(tmp_path / "journal"))
    proc = start_process([sys.executable, "-m", "pdserve.cli", "master"], address, timeout_s=60)
    try:
        assert (tmp_path / "journal").is_dir()
    finally:
        assert stop_process(proc, timeout_s=15) == 0


def test_an_unknown_environment_flag_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv("PDSERVE_MASTER_NO_SUCH_FLAG", "1")
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "master"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "--no-such-flag" in out.stderr
