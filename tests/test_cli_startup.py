"""The first minute with the `pdserve` command: it starts without torch, and bad input to
`pdserve serve` is refused at once, in one line naming the flag, before any process starts.

- `import pdserve.cli`, building the whole parser, `--help` of every light command, and what
  `pdserve serve` itself runs (its checks, the default model's path, the launcher) import
  neither torch, Ray, transformers nor a benchmark module (a fresh interpreter each).
- `pdserve serve --model BAD` (missing path, folder without config.json, a file that is not
  .gguf, a .gguf that is not GGUF) exits 2 within a generous 5 s, saying `--model` and the path,
  and never creates its log folder (nothing was started); bad key files likewise.
- Every registered benchmark and lazy command names a module that exists and offers the
  functions the registry says; a missing one is reported as such, not as a traceback.
- The admission and key flags of `pdserve serve` reach the router and the controller as flags
  their own parsers accept.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time

import pytest

from pdserve import cli
from pdserve.cli_serve import passthrough_args
from tests.helpers import parser_of

HEAVY = ("torch", "transformers", "ray", "pdserve.bench.decode", "pdserve.engine.loader")


def _fresh(code: str) -> subprocess.CompletedProcess:
    check = (f"\nheavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
             "assert not heavy, f'imported: {heavy}'\n")
    return subprocess.run([sys.executable, "-c", "import sys\n" + code + check],
                          capture_output=True, text=True, timeout=120)


def test_import_cli_imports_no_torch():
    out = _fresh("import pdserve.cli")
    assert out.returncode == 0, out.stderr


def test_building_the_whole_parser_imports_no_torch():
    out = _fresh("import pdserve.cli as c; p = c.build_parser(); "
                 "p.parse_args(['serve', '--model', 'm.gguf', '--max-in-flight', '4'])")
    assert out.returncode == 0, out.stderr


def test_serve_checks_its_input_and_imports_its_launcher_without_torch():
    """The `pdserve serve` process only supervises: the workers load the model, so it never
    holds torch (about 200 MB of memory)."""
    out = _fresh("import pdserve.cli as c, pdserve.cli_serve as s\n"
                 "a = c.build_parser().parse_args(['serve'])\n"
                 "assert s.input_problem(a) is None\n"
                 "from pdserve.engine.model_files import default_model_path\n"
                 "default_model_path()\n"
                 "import pdserve.launcher.local")
    assert out.returncode == 0, out.stderr


def test_serve_reads_a_drafter_without_torch(tmp_path):
    """`pdserve serve --draft PATH` learns the drafter's kind from its config.json and checks it
    before anything starts, still without torch; a bad drafter is refused naming --draft."""
    good = tmp_path / "drafter"
    good.mkdir()
    (good / "config.json").write_text(json.dumps({
        "kind": "dflash", "target_name": "t", "hidden_size": 8, "num_heads": 2, "head_dim": 4,
        "intermediate_size": 16, "format_version": 1}))
    (good / "draft.safetensors").write_bytes(b"")
    out = _fresh("import pdserve.cli as c, pdserve.cli_serve as s\n"
                 f"a = c.build_parser().parse_args(['serve', '--draft', {str(good)!r}])\n"
                 "assert s.input_problem(a) is None\n"
                 "f = s._spec_args(a)\n"
                 "assert f['spec_method'] == 'dflash', f\n")
    assert out.returncode == 0, out.stderr
    (good / "config.json").write_text(json.dumps({"kind": "dflash", "format_version": 99}))
    out = _fresh("import pdserve.cli as c, pdserve.cli_serve as s\n"
                 f"a = c.build_parser().parse_args(['serve', '--draft', {str(good)!r}])\n"
                 "try:\n    s._spec_args(a)\nexcept SystemExit as e:\n"
                 "    assert '--draft' in str(e) and 'format_version' in str(e), e\n"
                 "else:\n    raise AssertionError('accepted')\n")
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["generate", "--help"],
                                  ["bench", "--help"], ["ctl", "--help"], ["ray", "--help"]])
def test_help_imports_no_torch(argv):
    out = _fresh(f"import pdserve.cli as c\ntry:\n    c.main({argv!r})\n"
                 "except SystemExit as e:\n    assert e.code == 0, e.code\n")
    assert out.returncode == 0, out.stderr
    assert "usage: pdserve" in out.stdout


def _bad_models(tmp_path) -> list[str]:
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    text = tmp_path / "weights.bin"
    text.write_bytes(b"\0" * 64)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"<html>not found</html>")  # what a failed download leaves
    return [str(tmp_path / "missing.gguf"), str(folder), str(text), str(fake)]


def test_serve_refuses_a_bad_model_at_once_naming_the_flag(tmp_path):
    for i, model in enumerate(_bad_models(tmp_path)):
        logs = tmp_path / f"logs{i}"
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--model", model,
                              "--log-dir", str(logs), "--http-port", "0"],
                             capture_output=True, text=True, timeout=60)
        wall = time.monotonic() - t0
        assert out.returncode == 2, (model, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and f"--model {model}" in lines[0], out.stderr
        assert wall < 5.0, f"{model}: {wall:.1f} s"
        assert not logs.exists(), "the launcher started"  # it makes the folder first


def test_serve_refuses_bad_key_files_naming_the_flag(tmp_path):
    bad = tmp_path / "keys"
    bad.write_text("only-a-key\n")
    for flags, expect in ((["--api-keys-file", str(tmp_path / "none")], "--api-keys-file"),
                          (["--api-keys-file", str(bad)], "--api-keys-file"),
                          (["--admin-keys-file", str(tmp_path / "none")], "--admin-keys-file")):
        out = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--log-dir",
                              str(tmp_path / "logs"), *flags],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and expect in out.stderr, (flags, out.stderr)
        assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("name", sorted(cli.BENCHES))
def test_every_registered_bench_module_exists(name):
    _check_entry(cli.BENCHES[name])


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_lazy_command_module_exists(name):
    _check_entry(cli.COMMANDS[name])


def _check_entry(entry: cli.Lazy) -> None:
    module = importlib.import_module(entry.module)
    names = [entry.adder] if entry.adder else ["add_arguments", "run"]
    for n in names:
        assert callable(getattr(module, n, None)), f"{entry.module}.{n}"


def test_a_bench_module_that_is_missing_is_reported_not_raised(capsys):
    rc = cli.run_lazy("pdserve bench", "nope", cli.Lazy("pdserve.bench.no_such_bench", "x"), [])
    assert rc == 1
    assert "pdserve bench nope: not available" in capsys.readouterr().err


def test_bench_flags_come_from_the_module_only_when_it_runs():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "kvstore", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: pdserve bench kvstore") and "--json" in out.stdout



def test_serve_admission_and_key_flags_reach_the_router_and_controller(tmp_path):
    from pdserve.controller.__main__ import main as controller_main
    from pdserve.controller.config import ControllerConfig
    from pdserve.launcher.commands import command
    from pdserve.router.config import RouterConfig
    from pdserve.router.__main__ import main as router_main

    keys, admin = tmp_path / "keys", tmp_path / "admin"
    args = cli.build_parser().parse_args([
        "serve", "--served-model-name", "smol", "--max-in-flight-per-tenant", "3",
        "--tenant-rate-rps", "2.5", "--tenant-burst", "4", "--allow-special-tokens-in-messages",
        "--api-keys-file", str(keys), "--admin-keys-file", str(admin)])
    extra = passthrough_args(args)
    keys.write_text("sk-1 acme\n")
    admin.write_text("ak-1 ops\n")
    # As the launcher writes them into each process's command line, read by its own parser.
    router = RouterConfig("m", **extra["router_settings"])
    r = parser_of(router_main).parse_args(command(router)[1:])
    assert (r.model_name, r.max_in_flight_per_tenant, r.tenant_rate_rps, r.tenant_burst,
            r.allow_special_tokens_in_messages, r.admin_keys_file) == (
                "smol", 3, 2.5, 4, True, str(admin))
    controller = ControllerConfig("h:1", **extra["controller_settings"])
    c = parser_of(controller_main).parse_args(command(controller)[1:])
    assert (c.admin_keys_file, c.api_keys_file) == (str(admin), str(keys))
    # Unset flags pass nothing: the processes keep their own defaults.
    assert passthrough_args(cli.build_parser().parse_args(["serve"])) == {
        "router_settings": {}, "controller_settings": {}}


@pytest.mark.parametrize("flag,value", [("--max-in-flight", "0"), ("--tenant-rate-rps", "-1"),
                                        ("--max-predicted-ttft-s", "-2"),
                                        ("--tenant-burst", "0")])
def test_serve_refuses_out_of_range_admission_flags_naming_them(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["serve", flag, value])
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
