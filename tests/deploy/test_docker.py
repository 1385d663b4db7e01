"""The container image (deploy/docker): built offline by build.sh, the embedded cluster served
from one container with the same tokens as the in-process engine, its HEALTHCHECK, SIGTERM.

The image test is marked `docker` and runs only with PDSERVE_DOCKER_TESTS=1 (`.ci/docker` sets
it): it builds an image (minutes cold). It uses the daemon of DOCKER_HOST, else the default
socket, else starts a private one with deploy/docker/dockerd.sh (root and `dockerd` needed; it
is skipped, saying so, only where none can start). The healthcheck's pure core is tested always.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, free_port, parser_of, start_process, stop_process

DOCKER_DIR = REPO_ROOT / "deploy" / "docker"
GRACE_S = 30  # docker stop's grace before SIGKILL; the cluster must be gone well within it
MAX_TOKENS = 24


def _healthcheck():
    spec = importlib.util.spec_from_file_location("pdserve_healthcheck",
                                                  DOCKER_DIR / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


hc = _healthcheck()


# --- the healthcheck's pure core (always) -------------------------------------------------------

def test_finds_the_pdserve_process_behind_init_or_interpreter():
    cmdlines = {
        1: ["/sbin/docker-init", "--", "pdserve", "serve", "--port", "7001"],
        7: ["/opt/venv/bin/python", "/opt/venv/bin/pdserve", "serve", "--port", "7001"],
        9: ["/opt/venv/bin/python", "-m", "pdserve.worker", "--address", "127.0.0.1:7002"],
    }
    assert hc.find_pdserve(cmdlines) == (1, "serve", ["--port", "7001"])
    del cmdlines[1]
    assert hc.find_pdserve(cmdlines) == (7, "serve", ["--port", "7001"])
    assert hc.find_pdserve({3: ["python", "-m", "pdserve.cli", "router", "--address", "h:1"]}) \
        == (3, "router", ["--address", "h:1"])
    # A child of `pdserve serve` (python -m pdserve.worker) or `pdserve generate` is no server.
    assert hc.find_pdserve({9: cmdlines[9], 4: ["pdserve", "generate", "hi"]}) is None
    assert hc.find_pdserve({}) is None


def test_probe_for_serve_uses_the_router_host_and_port():
    assert hc.probe_for("serve", [], {}) == hc.Probe(
        "grpc", "127.0.0.1:50051", "serve --host/--port (the router)")
    p = hc.probe_for("serve", ["--host", "0.0.0.0", "--port=7001", "--http-port", "8001"], {})
    assert (p.how, p.address) == ("grpc", "127.0.0.1:7001")
    p = hc.probe_for("serve", ["--host", "10.1.2.3", "--port", "7001", "--port", "7005"], {})
    assert p.address == "10.1.2.3:7005"  # the last value wins, as in argparse


def test_probe_for_processes_reads_address_flag_then_environment_then_default():
    p = hc.probe_for("router", ["--address", "[::]:7003"],
                     {"PDSERVE_ROUTER_ADDRESS": "0.0.0.0:9"})
    assert (p.how, p.address, p.why) == ("grpc", "127.0.0.1:7003", "--address")
    p = hc.probe_for("worker", ["--role", "decode"], {"PDSERVE_WORKER_ADDRESS": "0.0.0.0:7004"})
    assert (p.address, p.why) == ("127.0.0.1:7004", "PDSERVE_WORKER_ADDRESS")
    assert hc.probe_for("master", [], {}).address == "127.0.0.1:50080"
    assert hc.probe_for("controller", [], {}).address == "127.0.0.1:50052"
    assert hc.probe_for("node", ["--data-address", "0.0.0.0:7100"], {}) == hc.Probe(
        "tcp", "127.0.0.1:7100", "--data-address")
    assert hc.probe_for("node", [], {}).how == "alive"  # data port chosen at start
    p = hc.probe_for("router", ["--address", "h:1"], {"PDSERVE_HEALTH_ADDRESS": "0.0.0.0:5"})
    assert (p.address, p.why) == ("127.0.0.1:5", "PDSERVE_HEALTH_ADDRESS")


def test_probe_for_speaks_the_processes_tls_or_its_plaintext_health_port():
    p = hc.probe_for("worker", ["--address", "0.0.0.0:7004", "--tls-dir", "/etc/t"], {})
    assert (p.address, p.tls) == ("127.0.0.1:7004", ("/etc/t", "worker"))
    p = hc.probe_for("master", [], {"PDSERVE_TLS_DIR": "/t"})
    assert p.tls == ("/t", "master")
    assert hc.probe_for("master", ["--insecure-internal"], {"PDSERVE_TLS_DIR": "/t"}).tls is None
    p = hc.probe_for("controller", ["--tls-dir", "/t", "--health-address", "0.0.0.0:9"], {})
    assert (p.how, p.address, p.tls) == ("grpc", "127.0.0.1:9", None)
    p = hc.probe_for("node", [], {"PDSERVE_NODE_HEALTH_ADDRESS": "0.0.0.0:8"})
    assert (p.how, p.address) == ("grpc", "127.0.0.1:8")
    # A router's --address is its client port: plaintext, or a connect when it has its own TLS.
    assert hc.probe_for("router", ["--address", "h:1", "--tls-dir", "/t"], {}).tls is None
    assert hc.probe_for("router", ["--address", "h:1", "--tls-cert", "c"], {}).how == "tcp"
    assert hc.probe_for("serve", ["--tls-cert", "c", "--tls-key", "k"], {}).how == "tcp"


def test_the_tls_probe_gets_an_answer_from_a_real_master(tmp_path, cluster_tls_dir):
    address = f"127.0.0.1:{free_port()}"
    p = start_process([sys.executable, "-m", "pdserve.kvstore.master", "--address", address,
                       "--journal-dir", str(tmp_path / "j")], address)
    try:
        ok, answer = hc._grpc_health(address, 5.0, (cluster_tls_dir, "master"))
        assert (ok, answer) == (True, "SERVING")
        ok, answer = hc._grpc_health(address, 5.0, None)  # plaintext: refused
        assert not ok and "UNAVAILABLE" in answer
    finally:
        stop_process(p)


def test_probe_for_refuses_bad_input_naming_it():
    with pytest.raises(ValueError, match="kind"):
        hc.probe_for("generate", [], {})
    with pytest.raises(ValueError, match="address.*'nowhere'"):
        hc.probe_for("router", ["--address", "nowhere"], {})



def test_healthcheck_defaults_are_the_processes_defaults():
    from pdserve import cli
    from pdserve.controller.__main__ import main as controller_main
    from pdserve.kvstore.master.__main__ import main as master_main
    from pdserve.kvstore.node.__main__ import main as node_main
    from pdserve.router.__main__ import main as router_main
    from pdserve.worker.__main__ import main as worker_main

    serve = cli.build_parser().parse_args(["serve"])
    assert hc.DEFAULT_ADDRESS["serve"] == f"{serve.host}:{serve.port}"
    for kind, main in (("master", master_main), ("worker", worker_main),
                       ("router", router_main), ("controller", controller_main)):
        assert hc.DEFAULT_ADDRESS[kind] == parser_of(main).get_default("address"), kind
    assert hc.DEFAULT_ADDRESS["node"] == parser_of(node_main).get_default("data_address")


# --- the image (PDSERVE_DOCKER_TESTS=1) -------------------------------------------------------

def _answers(client) -> bool:
    try:
        return bool(client.ping())
    except Exception:  # any connection error: nothing answers there
        return False


@pytest.fixture(scope="module")
def docker_client():
    import docker  # the test extra has it
    if os.environ.get("DOCKER_HOST"):
        client = docker.from_env()
        if not _answers(client):
            pytest.fail(f"DOCKER_HOST={os.environ['DOCKER_HOST']} is set but no daemon answers")
        yield client
        return
    if os.path.exists("/var/run/docker.sock"):
        client = docker.DockerClient(base_url="unix:///var/run/docker.sock")
        if _answers(client):
            yield client
            return
    if os.geteuid() != 0 or shutil.which("dockerd") is None:
        pytest.skip("no Docker daemon answers and none can start here: dockerd.sh needs root "
                    f"and the dockerd binary (euid {os.geteuid()}, dockerd "
                    f"{shutil.which('dockerd') or 'missing'}; apt-get install docker.io)")
    state = os.environ.get("PDSERVE_DOCKER_DIR", "/var/tmp/pdserve-dockerd")
    dockerd = ["bash", str(DOCKER_DIR / "dockerd.sh")]
    # A daemon already answering there is someone else's to stop.
    ours = subprocess.run([*dockerd, "status", state], capture_output=True).returncode != 0
    if ours:
        subprocess.run([*dockerd, "start", state], check=True)
    os.environ["DOCKER_HOST"] = f"unix://{state}/docker.sock"
    try:
        yield docker.from_env()
    finally:
        del os.environ["DOCKER_HOST"]
        if ours:
            subprocess.run([*dockerd, "stop", state], check=False)


def _version() -> str:
    import tomllib

    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


def _worker_base_port(taken: set[int]) -> int:
    """A free loopback port whose next one is free too (two workers listen on base, base+1)."""
    for _ in range(100):
        base = free_port()
        if {base, base + 1} & taken:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
        except OSError:
            continue
        return base
    raise RuntimeError("no two consecutive free loopback ports found")


def _generate(address: str, token_ids: list[int]) -> tuple[list[int], str]:
    from pdserve import rpc
    from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2

    req = api_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    req.token_ids.ids.extend(token_ids)
    ids, text = [], ""
    with rpc.make_channel(address, rpc.PUBLIC) as ch:
        for r in api_pb2_grpc.GenerationStub(ch).Generate(req, timeout=300):
            ids.extend(r.token_ids)
            text += r.text
    return ids, text


def _engine_tokens(prompt_ids: list[int]) -> list[int]:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.loader import default_model_path
    from pdserve.engine.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(default_model_path()))
    [tokens] = engine.generate([prompt_ids], SamplingParams(max_tokens=MAX_TOKENS,
                                                            temperature=0.0, ignore_eos=True))
    return list(tokens)


def _wait_healthy_router(container, address: str, timeout_s: float) -> None:
    from pdserve import rpc

    deadline = time.monotonic() + timeout_s
    while True:
        container.reload()
        if container.status != "running":
            raise AssertionError(f"container {container.status} before it was ready; logs:\n"
                                 + container.logs(tail=60).decode(errors="replace"))
        try:
            rpc.wait_healthy(address, timeout_s=2.0, peer=rpc.PUBLIC)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise AssertionError(f"router {address} not SERVING after {timeout_s}s; logs:\n"
                                     + container.logs(tail=60).decode(errors="replace"))


def _wait_docker_health(container, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        container.reload()
        health = container.attrs["State"]["Health"]
        if health["Status"] == "healthy" or time.monotonic() > deadline:
            return health
        time.sleep(2)


@pytest.mark.docker
@pytest.mark.timeout(1150)
@pytest.mark.skipif(os.environ.get("PDSERVE_DOCKER_TESTS") != "1",
                    reason="builds a container image (minutes): set PDSERVE_DOCKER_TESTS=1 or "
                           "run .ci/docker")
def test_image_serves_engine_tokens_reports_health_and_stops_on_sigterm(docker_client, capsys):
    import httpx

    from pdserve.engine.loader import default_model_path
    from pdserve.engine.tokenizer import Tokenizer

    tag = f"pdserve:{_version()}"
    # The fixture's daemon: DOCKER_HOST, or the default socket when it is unset.
    built = subprocess.run(["bash", str(DOCKER_DIR / "build.sh"), "--tag", tag],
                           capture_output=True, text=True)
    summary = [line for line in built.stdout.splitlines() if line.startswith("build.sh:")]
    with capsys.disabled():
        print("\n" + "\n".join(summary))
    assert built.returncode == 0, \
        f"build.sh failed:\n{built.stdout[-4000:]}\n{built.stderr[-4000:]}"

    image = docker_client.images.get(tag)
    config = image.attrs["Config"]
    assert config["Entrypoint"] == ["pdserve"]
    assert config["User"] not in ("", "0", "root") and not config["User"].startswith("0:")
    assert config["Healthcheck"]["Test"][0] == "CMD"
    assert config["Labels"]["org.opencontainers.image.version"] == _version()
    assert not any(t.endswith(":latest") for t in image.tags), image.tags

    tok = Tokenizer.from_path(default_model_path())
    prompt_ids = tok.encode("The three primary colors are", add_special_tokens=False)
    expected = _engine_tokens(prompt_ids)

    ports: set[int] = set()
    while len(ports) < 4:
        ports.add(free_port())
    worker_base = _worker_base_port(ports)
    port, http_port, store_port, controller_port = sorted(ports)
    router = f"127.0.0.1:{port}"
    container = docker_client.containers.run(
        tag, name=f"pdserve-test-{uuid.uuid4().hex[:8]}", detach=True, init=True,
        network_mode="host", shm_size="2g",
        command=["serve", "--port", str(port), "--http-port", str(http_port),
                 "--store-port", str(store_port), "--worker-base-port", str(worker_base),
                 "--controller-port", str(controller_port)])
    try:
        # What the Helm chart's start scripts use, as the image's non-root user.
        uid = container.exec_run(["id", "-u"]).output.decode().strip()
        assert uid != "0" and uid.isdigit(), uid
        probe = container.exec_run(["/bin/sh", "-c", "command -v sed pdserve python && python -c "
                                    "'import pdserve.engine.loader as l; "
                                    "print(l.default_model_path())'"])
        assert probe.exit_code == 0, probe.output.decode(errors="replace")

        _wait_healthy_router(container, router, timeout_s=420)
        ids, text = _generate(router, prompt_ids)
        assert ids == expected
        http = f"http://127.0.0.1:{http_port}/v1"
        model = httpx.get(f"{http}/models", timeout=30).json()["data"][0]["id"]
        reply = httpx.post(f"{http}/completions", timeout=120, json={
            "model": model, "prompt": prompt_ids,
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == text

        health = _wait_docker_health(container, timeout_s=120)
        assert health["Status"] == "healthy", health
        last = health["Log"][-1]
        assert last["ExitCode"] == 0 and f"grpc {router}" in last["Output"], last

        container.stop(timeout=GRACE_S)  # SIGTERM, SIGKILL after the grace
        container.reload()
        state = container.attrs["State"]
        # 0, not 137: the cluster stopped on SIGTERM within the grace, not killed after it.
        assert (state["Status"], state["ExitCode"], state["OOMKilled"]) == ("exited", 0, False), \
            container.logs(tail=40).decode(errors="replace")
    finally:
        container.remove(force=True)
