"""The local launcher and Ray's plan write each process's command line from the same config
functions (`launcher/commands.py`): the router's differs between them only where it runs, and
the spec's typed settings reach it, checked against the router's own parser."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.core.errors import ConfigError
from pdserve.deploy.ray import plan
from pdserve.launcher.cluster_spec import ClusterSpec
from pdserve.launcher.local import LocalCluster
from tests.deploy.test_ray_plan import parsed


def test_the_local_and_the_ray_router_differ_only_where_they_run(tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("")
    key.write_text("")
    spec = ClusterSpec("/m", cluster_id="c1", max_in_flight=7, tls_cert=str(cert),
                       tls_key=str(key), router_settings={"stats_interval_s": 0.2,
                                                          "max_in_flight": 9})
    cluster = LocalCluster(spec.resolved())
    local = parsed(["router", *cluster._router_argv({"h:1": "prefill", "h:2": "decode"},
                                                    cluster.router_control_address)[1:]])
    assert (local.prefill_addresses, local.decode_addresses) == (("h:1",), ("h:2",))
    assert local.max_in_flight == 9 and local.stats_interval_s == 0.2  # the settings win
    assert local.tls_cert == str(cert)
    s = cluster.spec
    ray = parsed(plan.router_args(plan.RaySpec(s), cluster.router_address,
                                  f"{s.http_host}:{s.http_port}", cluster.router_control_address,
                                  cluster.store_address))
    assert dataclasses.replace(local, prefill_addresses=(), decode_addresses=()) == ray
    # Several front doors on one host share the client ports; one alone does not.
    assert not local.share_port
    two = LocalCluster(dataclasses.replace(spec, routers=2).resolved())
    assert parsed(["router", *two._router_argv({}, "h:9")[1:]]).share_port


def test_a_setting_the_config_does_not_have_is_refused_naming_it():
    with pytest.raises(ConfigError, match="router_settings: RouterConfig has no field 'nope'"):
        ClusterSpec("/m", router_settings={"nope": 1})
    with pytest.raises(ConfigError, match="controller_settings: .* 'max_in_flight'"):
        ClusterSpec("/m", controller_settings={"max_in_flight": 1})


def test_port_0_means_a_free_port_the_cluster_then_reports():
    spec = ClusterSpec("/m", router_port=0, http_port=0, store_port=0).resolved()
    ports = {spec.router_port, spec.http_port, spec.store_port, *spec.worker_ports}
    assert 0 not in ports and len(ports) == 3 + len(spec.worker_ports)
    assert LocalCluster(spec).router_address == f"{spec.host}:{spec.router_port}"
