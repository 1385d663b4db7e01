"""Command line of one storage node: `python -m pdserve.kvstore.node --node-id N --dram-bytes B`.

Owns argument parsing (`NodeConfig`'s fields as flags, `pdserve.flags`, and the internal-TLS
flags `--tls-dir` / `--insecure-internal`, set as this process's setting right after parsing;
`--ucx-port` only with `--insecure-internal`, UCX having no TLS), the plaintext gRPC health port of
`--health-address` (for probes that speak no TLS: NOT_SERVING until the data server runs,
SERVING while it does, NOT_SERVING once refused or stopping), and the ready line: one JSON
object on one stdout line (bound data address, segment ids, shm paths) once the node serves.
Everything else is in `config` and `service`. Exit codes: 0 after SIGTERM/SIGINT, 1 if the
node cannot start or a master refuses it (another cluster: `--cluster-id`, the message names
both ids), 2 for bad arguments (a bad TLS folder, `--ucx-port` under TLS). Its segment files
are gone on every one of these exits.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys

from pdserve import rpc
from pdserve.flags import add_config_flags, config_from_args
from pdserve.lifecycle import die_with_parent_if_asked
from pdserve.kvstore import config as store_config
from pdserve.kvstore.channel import ClusterMismatch, check_cluster_id
from pdserve.core.errors import ConfigError
from pdserve.kvstore.node.config import NodeConfig
from pdserve.kvstore.node.service import UCX_NEEDS_INSECURE, NodeInfo, NodeStartError, serve
from pdserve.security import cli as security_cli


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.kvstore.node",
        description="Run one KV-store storage node: DRAM segment (+ SSD tier) behind a TCP "
                    "data server.")
    add_config_flags(parser, NodeConfig, defaults={"host_id": socket.gethostname()})
    security_cli.add_flags(parser)
    args = parser.parse_args(argv)
    security = security_cli.configure(args, "node", parser)
    if args.ucx_port is not None and not security.insecure:
        parser.error(UCX_NEEDS_INSECURE)
    try:
        check_cluster_id(args.cluster_id)
        config = config_from_args(NodeConfig, args)
    except (ConfigError, store_config.ConfigError) as e:
        parser.error(str(e))

    membership = []
    health = _Health()
    if args.health_address:
        try:
            health.serve(args.health_address)
        except RuntimeError as e:
            print(f"pdserve.kvstore.node: cannot bind --health-address {args.health_address}: "
                  f"{e}", file=sys.stderr)
            return 1

    def refused(_message: str) -> None:
        health.stopping()
        os.kill(os.getpid(), signal.SIGTERM)  # stop serving: the main thread cleans up

    def announce(info: NodeInfo) -> None:
        if config.masters:
            from pdserve.kvstore.node.registration import Membership

            m = Membership(info, list(config.masters), config.heartbeat_s, config.cluster_id,
                           on_refused=refused)
            membership.append(m)
            # Best effort now (the heartbeat thread retries until a master answers), except a
            # refusal: ClusterMismatch ends `serve`, which removes the segment files.
            m.register()
            m.start()
        health.serving()
        # One JSON line on stdout: scripts and tests wait for it, then connect.
        print(json.dumps({"event": "ready", "pid": os.getpid(), **info.to_json_dict()}),
              flush=True)

    try:
        serve(config, on_ready=announce, on_stop=health.stopping, security=security)
    except NodeStartError as e:
        print(f"pdserve.kvstore.node: {e}", file=sys.stderr)
        return 1
    except ClusterMismatch as e:
        print(f"pdserve.kvstore.node: refused by the store master: {e}", file=sys.stderr)
        return 1
    finally:
        health.stopping()
        for m in membership:
            m.stop()
        health.close()
    for m in membership:
        if m.refused is not None:
            print(f"pdserve.kvstore.node: refused by the store master: {m.refused}",
                  file=sys.stderr)
            return 1
    return 0


class _Health:
    """The node's overall health on a plaintext gRPC port of its own, when asked for one."""

    def __init__(self) -> None:
        self._servicer = None
        self._server = None

    def serve(self, address: str) -> None:
        from grpc_health.v1 import health

        self._servicer = health.HealthServicer()
        self._set("NOT_SERVING")  # until the data server runs
        self._server, _ = rpc.serve_health(self._servicer, address)

    def _set(self, status: str) -> None:
        if self._servicer is not None:
            from grpc_health.v1 import health_pb2

            self._servicer.set("", getattr(health_pb2.HealthCheckResponse, status))

    def serving(self) -> None:
        self._set("SERVING")

    def stopping(self) -> None:
        if self._servicer is not None:
            self._servicer.enter_graceful_shutdown()  # NOT_SERVING, and it stays so

    def close(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None


if __name__ == "__main__":
    sys.exit(main())
