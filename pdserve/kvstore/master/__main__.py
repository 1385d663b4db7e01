"""`python -m pdserve.kvstore.master --address H:P (--journal-dir D | --redis-url URL)`.

Its flags are `MasterConfig`'s fields (`pdserve.flags`), and the internal-TLS ones. Embedded
default: metadata journaled to a local directory. Cluster mode: journal and leader
lease in Redis; start several masters with the same --redis-url and distinct --address: one
leads, the others stand by and take over when its lease lapses.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from pdserve import logctx
from pdserve.flags import add_config_flags, config_from_args
from pdserve.lifecycle import die_with_parent_if_asked
from pdserve import rpc
from pdserve.kvstore.channel import check_cluster_id
from pdserve.core.errors import ConfigError
from pdserve.core.identity import MASTER
from pdserve.security import cli as security_cli
from pdserve.kvstore.master.config import MasterConfig
from pdserve.kvstore.master.model import ClusterIdConflict


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    p = argparse.ArgumentParser(prog="python -m pdserve.kvstore.master")
    add_config_flags(p, MasterConfig)
    security_cli.add_flags(p)
    a = p.parse_args(argv)
    security_cli.configure(a, MASTER, p)
    if bool(a.journal_dir) == bool(a.redis_url):
        p.error("give exactly one of --journal-dir or --redis-url")
    try:
        check_cluster_id(a.cluster_id)
        config = config_from_args(MasterConfig, a)
    except ConfigError as e:
        p.error(str(e))
    logctx.configure(logging.INFO)
    from pdserve.kvstore.master.journal import FileJournal, RedisJournal
    from pdserve.kvstore.master.members_service import MembersService
    from pdserve.kvstore.master.service import MasterService
    from pdserve.kvstore.transport.tcp import TcpTransport
    from pdserve.proto import cluster_pb2_grpc as cpb_grpc
    from pdserve.proto import kvmaster_pb2_grpc as pb_grpc

    election = None
    if config.redis_url:
        import redis

        from pdserve.kvstore.master.election import LeaderElection

        client = redis.Redis.from_url(config.redis_url)
        journal = RedisJournal(client, fence=(config.lease_key, config.address))
        election = LeaderElection(client, config.lease_key, config.address,
                                  config.leader_lease_s)
    else:
        journal = FileJournal(config.journal_dir)
    try:
        service = MasterService(config, journal, election=election, address=config.address,
                                transport=TcpTransport(), cluster_id=config.cluster_id)
        service.campaign()
    except ClusterIdConflict as e:
        if election is not None:
            election.release()
        print(f"pdserve.kvstore.master: {e}", file=sys.stderr, flush=True)
        return 1
    members = MembersService(service)
    rpc.catch_stop_signals()  # before the thread below may signal this process
    stop = threading.Event()
    refused: list[str] = []

    def maintain() -> None:
        period = config.tick_s if election is None else min(config.tick_s,
                                                             config.leader_lease_s / 3)
        while not stop.wait(period):
            try:
                if service.campaign():
                    service.tick()
                    members.tick()
            except ClusterIdConflict as e:  # took over a journal of another cluster
                election.release()
                refused.append(str(e))
                os.kill(os.getpid(), signal.SIGTERM)  # the main thread stops serving
                return
            except Exception:  # keep the loop alive; the next round retries
                logging.getLogger(__name__).exception("maintenance round failed")

    threading.Thread(target=maintain, name="master-maintenance", daemon=True).start()
    server = rpc.make_server(32)
    rpc.add_servicer(server, pb_grpc.add_KVMasterServicer_to_server, service, rpc.Guard(MASTER))
    rpc.add_servicer(server, cpb_grpc.add_ClusterMembersServicer_to_server, members,
                     rpc.Guard(MASTER))
    health = rpc.add_health_and_reflection(server, ["pdserve.v1.KVMaster",
                                                    "pdserve.v1.ClusterMembers"])
    code = rpc.run_until_signal(server, health, config.address,
                                lambda where: f"pdserve.kvstore.master ready on {where} "
                                              f"leader={service.is_leader()}", MASTER,
                                health_address=a.health_address)
    stop.set()
    if election is not None and service.is_leader():
        election.release()
    if refused:
        print(f"pdserve.kvstore.master: {refused[0]}", file=sys.stderr, flush=True)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
