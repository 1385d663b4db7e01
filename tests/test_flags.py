"""Every service's flags come from its config (`pdserve.flags`), and `config_argv` is their
exact inverse: the real parser of each process reads back the config its command line was
written from, for hand-picked configs and for random changes to them."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields, replace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pdserve.controller.__main__ import main as controller_main
from pdserve.controller.config import ControllerConfig
from pdserve.core.errors import ConfigError
from pdserve.flags import add_config_flags, config_argv, config_from_args, flag, flag_name
from pdserve.kvstore.__main__ import main as store_main
from pdserve.kvstore.config import StoreConfig
from pdserve.kvstore.master.__main__ import main as master_main
from pdserve.kvstore.master.config import MasterConfig
from pdserve.kvstore.node.__main__ import main as node_main
from pdserve.kvstore.node.config import NodeConfig
from pdserve.router.__main__ import main as router_main
from pdserve.router.config import RouterConfig
from pdserve.worker.__main__ import main as worker_main
from pdserve.worker.config import WorkerConfig
from tests.helpers import parser_of

MAINS = {RouterConfig: router_main, WorkerConfig: worker_main,
         ControllerConfig: controller_main, MasterConfig: master_main, NodeConfig: node_main,
         StoreConfig: store_main}


def parse(cls, argv: list[str]):
    """`cls` as its process's own parser reads `argv`."""
    return config_from_args(cls, parser_of(MAINS[cls]).parse_args(argv))


# Configs with every field that is a flag away from its default, service by service.
CASES = {
    "router": RouterConfig(
        "/m/model.gguf", prefill_addresses=("p:1", "p:2"), decode_addresses=("d:1",),
        address="0.0.0.0:1", control_address="h:2", model_name="smol", dtype="bfloat16",
        max_model_len_tokens=4096, rpc_threads=200, max_concurrent_rpcs=5000,
        request_timeout_s=1.5, routing="kv_aware", decode_routing="round_robin",
        decode_streams="per_request", block_size_tokens=32, max_local_prefill_tokens=0,
        store_address="s:1,s:2", kv_overlap_weight=0.5, kv_fetch_weight=1.0,
        kv_request_cost_tokens=3.25, routing_seed=-7, stats_interval_s=0.2,
        max_missed_polls=5, http_host="::", http_port=0, http_max_body_bytes=4096,
        http_max_connections=300, max_in_flight=2, max_in_flight_per_tenant=1,
        tenant_rate_rps=2.5, tenant_burst=4, max_predicted_ttft_s=0.0,
        shutdown_grace_s=0.5, allow_special_tokens_in_messages=True),
    "worker": WorkerConfig(
        "/m", role="decode", address="h:1", store_address="s:1", host_id="node-a",
        dtype="float32", quantization="int8", device="cpu", num_blocks=8,
        max_num_batched_tokens=64, threads=2, core_ledger="/tmp/ledger", max_threads=4,
        core_sharing="turns", spec_method="ngram", spec_schedule=False, progressive_kv=True,
        metrics_port=0, register_with="r:1", advertise_address="h:1", cluster_id="c-1",
        store_retry_budget_s=0.25, model_name="smol"),
    "controller": ControllerConfig(
        "r:1", store_address="m:1", address="h:2", mode="advisory", tick_s=0.5, ttft_slo_ms=100.0,
        fluid_token=False, cooldown_s=0.0, audit_log="/tmp/a.jsonl", metrics_port=0,
        api_keys_file="/k", rpc_threads=4),
    "master": MasterConfig(high_watermark=0.5, low_watermark=0.25, lease_s=1.0,
                           eviction_sample=16, promote_on_read=False, address="h:3",
                           journal_dir="/j", redis_url="redis://r:6379", tick_s=0.1,
                           cluster_id="c"),
    "node": NodeConfig("n-1", "host", 1 << 20, data_address="h:0", ssd_dir="/ssd",
                       ssd_bytes=1 << 30, ssd_fsync=True, preallocate=False, ucx_port=0,
                       masters=("m:1", "m:2"), heartbeat_s=0.5, cluster_id="c"),
    "store": StoreConfig(address="h:9", capacity_bytes=1 << 20, max_workers=2),
}


@pytest.mark.parametrize("name", CASES)
def test_a_config_comes_back_from_its_command_line(name):
    cfg = CASES[name]
    assert parse(type(cfg), config_argv(cfg)) == cfg


# Configs that need one of several settings (the controller: a router, or the store master
# whose membership lists the routers): the one a bare config is given.
ONE_OF = {"controller": "store_address"}


@pytest.mark.parametrize("name", CASES)
def test_a_default_config_has_only_its_required_flags(name):
    cls = type(CASES[name])
    required = [f for f in fields(cls) if f.default is MISSING or f.name == ONE_OF.get(name)]
    bare = cls(**{f.name: getattr(CASES[name], f.name) for f in required})
    argv = config_argv(bare)
    assert [a for a in argv if a.startswith("--")] == [flag_name(f) for f in required]
    assert parse(cls, argv) == bare


def test_the_router_keeps_its_flag_spellings_and_derives_its_bounds():
    p = parser_of(router_main)
    a = p.parse_args(["--model", "m", "--prefill", "a:1, b:2", "--decode", "",
                      "--allow-special-tokens-in-messages", "--max-model-len-tokens", "64"])
    cfg = config_from_args(RouterConfig, a)
    assert (cfg.model_path, cfg.prefill_addresses, cfg.decode_addresses) == (
        "m", ("a:1", "b:2"), ())
    assert cfg.allow_special_tokens_in_messages and cfg.max_model_len_tokens == 64
    assert cfg.http_port is None and cfg.rpc_threads == 128 + 32  # derived, not a flag's
    # A derived bound is not written back: the command line stays what was chosen.
    cfg = RouterConfig("m", prefill_addresses=("a:1", "b:2"), max_model_len_tokens=64,
                       max_in_flight=10, allow_special_tokens_in_messages=True)
    assert cfg.rpc_threads == 10 + 32
    assert config_argv(cfg) == [
        "--model", "m", "--prefill", "a:1,b:2", "--max-model-len-tokens", "64",
        "--max-in-flight", "10", "--allow-special-tokens-in-messages"]
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--routing", "fastest"])  # choices
    # A switch: named alone it is on; a true/false word may follow (the environment's form).
    for words, on in ((["--allow-special-tokens-in-messages", "false"], False),
                      (["--allow-special-tokens-in-messages", "true"], True),
                      (["--allow-special-tokens-in-messages"], True), ([], False)):
        assert p.parse_args(["--model", "m", *words]).allow_special_tokens_in_messages is on
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--allow-special-tokens-in-messages", "maybe"])
    assert "workers to start with" in p.format_help()


def test_a_value_that_looks_like_a_flag_is_written_so_it_reads_back():
    cfg = replace(CASES["controller"], metrics_port=-1, audit_log="-x")
    argv = config_argv(cfg)
    assert "--audit-log=-x" in argv
    assert parse(ControllerConfig, argv) == cfg


def test_the_node_host_defaults_to_this_machine_and_the_store_keeps_its_flags():
    import socket

    a = parser_of(node_main).parse_args(["--node-id", "n", "--dram-bytes", "1048576",
                                         "--master", "m:1,m:2", "--ssd-fsync"])
    assert (a.host_id, a.masters, a.ssd_fsync) == (socket.gethostname(), ("m:1", "m:2"), True)
    s = parser_of(store_main).parse_args(["--capacity-bytes", "2048", "--max-workers", "3"])
    assert (s.capacity_bytes, s.max_workers) == (2048, 3)


def test_a_switch_set_from_the_environment_reads_as_its_word_says():
    from pdserve.entrypoints import env_flags

    required = ["--node-id", "n", "--dram-bytes", "1048576"]
    for word, on in (("true", True), ("1", True), ("false", False), ("off", False)):
        argv = env_flags("node", {"PDSERVE_NODE_SSD_FSYNC": word}) + required
        assert parser_of(node_main).parse_args(argv).ssd_fsync is on, word


def test_a_field_the_flags_cannot_write_is_refused_not_mangled():
    with pytest.raises(ValueError, match="prefill_addresses"):
        config_argv(replace(CASES["router"], prefill_addresses=("a:1,b:2",)))


def test_flags_follow_the_field_metadata():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class C:
        path: str = flag(name="--file", help="where")
        on: bool = flag(False, switch=True)
        mode: str = flag("a", choices=("a", "b"))
        n: int | None = None
        names: tuple[str, ...] = ()

    p = add_config_flags(argparse.ArgumentParser(), C)
    c = config_from_args(C, p.parse_args(["--file", "x", "--on", "--n", "3", "--names", "u,v"]))
    assert c == C("x", True, "a", 3, ("u", "v"))
    assert isinstance(c.n, int)
    assert config_argv(c) == ["--file", "x", "--on", "--n", "3", "--names", "u,v"]
    assert config_from_args(C, p.parse_args(["--file", "x"])) == C("x")


# Random changes to the configs above: each value drawn for its field's type.
def _values(f):
    text = str(f.type).replace(" ", "")
    base = text.removesuffix("|None")
    pick = {"int": st.integers(-1, 1 << 40), "float": st.floats(0, 1e6, allow_nan=False),
            "bool": st.booleans(),
            "str": st.text("abcxyz019:/._-=", min_size=0, max_size=12),
            "tuple[str,...]": st.lists(st.from_regex(r"[a-z0-9.]{1,8}:[0-9]{1,5}",
                                                     fullmatch=True), max_size=3).map(tuple)}
    values = pick[base]
    return st.one_of(st.none(), values) if text.endswith("|None") else values


@settings(max_examples=300, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.data())
def test_any_config_comes_back_from_its_command_line(data):
    base = data.draw(st.sampled_from(list(CASES.values())))
    changed = data.draw(st.lists(st.sampled_from(fields(base)), min_size=1, max_size=3,
                                 unique_by=lambda f: f.name))
    try:
        cfg = replace(base, **{f.name: data.draw(_values(f)) for f in changed})
    except (ConfigError, ValueError, TypeError):
        assume(False)
    try:
        argv = config_argv(cfg)
    except ValueError:  # None where the default is not None: no flag writes it
        assume(False)
    assert parse(type(cfg), argv) == cfg


def test_a_value_argparse_cannot_carry_is_refused_when_the_command_line_is_built():
    # "--" ends argparse's flags, even as "--cluster-id=--": it would come back as [].
    with pytest.raises(ValueError, match="cluster_id: '--' cannot be given on a command line"):
        config_argv(MasterConfig(cluster_id="--"))
    argv = config_argv(MasterConfig(cluster_id="-a"))  # a leading "-" alone is written inline
    assert argv == ["--cluster-id=-a"] and parse(MasterConfig, argv).cluster_id == "-a"
