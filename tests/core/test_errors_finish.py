"""One configuration error type across services, and finish reasons that cross the wire."""

from __future__ import annotations

import pytest

from pdserve.core import finish
from pdserve.core.errors import ConfigError


def test_every_service_raises_the_one_config_error():
    from pdserve.launcher.cluster_spec import ClusterSpec
    from pdserve.kvstore.config import StoreConfig
    from pdserve.kvstore.node.config import NodeConfig
    from pdserve.router.config import RouterConfig

    with pytest.raises(ConfigError, match="prefill_workers"):
        ClusterSpec(model_path="m", prefill_workers=0)
    with pytest.raises(ConfigError, match="node_id"):
        NodeConfig(node_id="bad id!", host_id="h", dram_bytes=1 << 20)
    with pytest.raises(ConfigError, match="address"):
        StoreConfig(address="nohost")
    with pytest.raises(ConfigError, match="block_size_tokens"):
        RouterConfig(model_path="m", block_size_tokens=0)
    assert issubclass(ConfigError, ValueError)  # callers that caught ValueError still do


def test_finish_reasons_round_trip_through_the_wire():
    from pdserve.wire import finish_from_proto, finish_to_proto

    for reason in finish.FinishReason:
        assert finish_from_proto(finish_to_proto(reason)) == reason
        assert finish_to_proto(str(reason)) == finish_to_proto(reason)  # plain strings too
    assert finish.STOP == "stop" and f"{finish.LENGTH}" == "length"
    assert finish.ABORT not in finish.COMPLETED


def test_the_cores_errors_are_one_class_each_wherever_imported():
    from pdserve.core import errors
    from pdserve.engine import block_pool, scheduler, sequence
    from pdserve.router import membership, policy

    assert block_pool.NoFreeBlocksError is errors.NoFreeBlocksError
    assert scheduler.QueueFullError is sequence.QueueFullError is errors.QueueFullError
    assert policy.NoWorkerError is errors.NoWorkerError
    assert membership.UnknownMemberError is errors.UnknownMemberError
    assert str(errors.UnknownMemberError("no worker d9")) == "no worker d9"  # not quoted
    assert issubclass(errors.UnknownMemberError, KeyError)
    assert issubclass(errors.QueueFullError, RuntimeError)
