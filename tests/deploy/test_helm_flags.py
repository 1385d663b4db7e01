"""The chart's command lines against the processes' real parsers: Helm templates cannot call
`pdserve.launcher.commands`, so every pdserve container the chart renders, in every value set,
has its flags (the `PDSERVE_<KIND>_<FLAG>` variables it sets included) read by its process's own
parser into a valid config. A flag renamed in a config, or a value a config refuses, fails here.
And where the chart sets a field to something else than the config's default, that is one of
the differences listed below with its reason: a default changed on one side only shows up.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import MISSING, fields
from unittest import mock

import pytest

from pdserve.controller.config import ControllerConfig
from pdserve.core.errors import ConfigError
from pdserve.entrypoints import PROCESSES, env_flags
from pdserve.flags import config_from_args
from pdserve.kvstore.master.config import MasterConfig
from pdserve.kvstore.node.config import NodeConfig
from pdserve.router.config import RouterConfig
from pdserve.worker.config import WorkerConfig
from tests.deploy.chart import VALUE_SETS, argv, containers, merged, needs_helm, objects, workloads
from tests.helpers import parser_of

pytestmark = needs_helm

CONFIGS = {"master": MasterConfig, "node": NodeConfig, "worker": WorkerConfig,
           "router": RouterConfig, "controller": ControllerConfig}
# What Kubernetes puts for `$(VAR)`, and the launch script for "$MODEL_PATH" and the role.
POD_ENV = {"POD_IP": "10.1.2.3", "POD_NAME": "pdserve-worker-0", "POD_NAMESPACE": "ns"}
MODEL = "/models/m.gguf"
SCRIPT_ENV = {"PDSERVE_WORKER_ROLE": "decode"}

# Fields the chart sets away from the config's default, on purpose.
DELIBERATE = {
    # A pod listens on every interface, on the chart's fixed ports, and says where it is.
    ("master", "address"), ("node", "data_address"), ("node", "masters"),
    ("worker", "address"), ("worker", "advertise_address"),
    ("worker", "store_address"), ("router", "address"), ("router", "control_address"),
    ("router", "http_host"), ("router", "http_port"), ("router", "store_address"),
    ("controller", "address"),
    # The cluster's membership table on the store master: each router lists its pod IP there,
    # the controller finds every router and moves workers there.
    ("router", "advertise_control_address"), ("controller", "store_address"),
    ("master", "journal_dir"), ("master", "redis_url"),
    ("controller", "audit_log"), ("controller", "metrics_port"), ("worker", "metrics_port"),
    ("worker", "role"),
    # Mounted Secrets.
    ("router", "tls_cert"), ("router", "tls_key"), ("router", "tls_client_ca"),
    ("router", "api_keys_file"), ("router", "admin_keys_file"),
    ("controller", "admin_keys_file"),
    # A cluster id of the release, names and sizes from the values.
    ("worker", "cluster_id"), ("node", "cluster_id"), ("master", "cluster_id"),
    ("worker", "model_name"), ("router", "model_name"),
    ("router", "max_model_len_tokens"),  # a worker's whole pool, as the launcher's
    # Pods have no device to resolve "auto" against: a fixed dtype and step budget.
    ("worker", "dtype"), ("worker", "max_num_batched_tokens"),
    ("worker", "num_blocks"),  # the GPU value set's bigger pool
    # Value sets that tune the router's admission and shutdown.
    ("router", "max_predicted_ttft_s"), ("router", "max_local_prefill_tokens"),
    ("router", "shutdown_grace_s"),
}

EXTRA_SETS = {"named": merged(VALUE_SETS["everything"], {
    "model": {"name": "smol"},
    "router": {"maxLocalPrefillTokens": 0, "shutdownGraceSeconds": 10}})}


def pdserve_commands(objs: list[dict]):
    """(workload/container, kind, the flags its process reads) of every pdserve container."""
    for w in workloads(objs):
        for c in containers(w):
            words = argv(c)
            if "pdserve" not in words:
                continue
            i = words.index("pdserve")
            kind, flags = words[i + 1], words[i + 2:]
            if kind not in CONFIGS:
                continue
            if "exec \"$@\" --model \"$MODEL_PATH\"" in " ".join(words[:i]):
                flags += ["--model", MODEL]
            env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
            if "PDSERVE_WORKER_ROLE" in " ".join(words[:i]):
                env.update(SCRIPT_ENV)
            flags = [_expand(f) for f in env_flags(kind, env) + flags]
            yield f"{w['metadata']['name']}/{c['name']}", kind, flags


def _expand(word: str) -> str:
    for name, value in POD_ENV.items():
        word = word.replace(f"$({name})", value)
    return word


class _Refused(Exception):
    pass


def parse(kind: str, flags: list[str]):
    """The config `pdserve <kind> FLAGS` starts with, by its process's own parser."""
    parser = parser_of(importlib.import_module(PROCESSES[kind][0]).main)

    def refuse(message):
        raise _Refused(message)

    with mock.patch.object(argparse.ArgumentParser, "error", side_effect=refuse):
        args = parser.parse_args(flags)
    # The TLS and key files are Secrets mounted in the pod, not files here.
    with mock.patch("pdserve.router.config.os.path.isfile", return_value=True):
        return config_from_args(CONFIGS[kind], args)


@pytest.mark.parametrize("name", sorted({**VALUE_SETS, **EXTRA_SETS}))
def test_every_flag_the_chart_passes_is_one_its_process_knows_with_a_valid_value(name):
    values = {**VALUE_SETS, **EXTRA_SETS}[name]
    seen = set()
    for where, kind, flags in pdserve_commands(objects(values)):
        try:
            cfg = parse(kind, flags)
        except (_Refused, ConfigError) as e:
            pytest.fail(f"{name}: {where}: `pdserve {kind} {' '.join(flags)}`: {e}")
        seen.add(kind)
        for f in fields(CONFIGS[kind]):
            value = getattr(cfg, f.name)
            if f.default is MISSING or value == f.default or (kind, f.name) in DELIBERATE \
                    or _derived(cfg, f.name):
                continue
            pytest.fail(f"{name}: {where} sets {kind} {f.name} to {value!r}, the config's "
                        f"default is {f.default!r}: make them agree, or list it in "
                        f"DELIBERATE with why")
    assert {"master", "node", "worker", "router"} <= seen, seen


def _derived(cfg, field_name: str) -> bool:
    """A bound the config derives itself when left unset (the router's thread counts)."""
    return isinstance(cfg, RouterConfig) and field_name in (
        "rpc_threads", "max_concurrent_rpcs", "http_max_connections")


def test_a_renamed_flag_is_caught():
    """The check above can fail: a flag the router does not know is refused by name."""
    [(where, kind, flags)] = [c for c in pdserve_commands(objects({})) if c[1] == "router"]
    flags = [("--max-inflight" if f == "--max-in-flight" else f) for f in flags]
    with pytest.raises(_Refused, match="--max-inflight"):
        parse(kind, flags)
