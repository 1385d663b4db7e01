"""`pdserve ctl`: see and steer the controller (status, rebalance, set-role, pin, mode).

Owns what an operator types and sees: rich tables, or `--json` on every command; errors as one
clear line and a non-zero exit (an unreachable controller, an unknown worker, a refused key),
never a traceback. Talks only to the controller's gRPC API (`--address`, default
$PDSERVE_CONTROLLER_ADDRESS, else the cluster `pdserve serve` runs on this machine
(`runfile`), else 127.0.0.1:50052) over TLS, as the cluster's operator (`--tls-dir`, default
$PDSERVE_TLS_DIR or that cluster's folder) or with `--admin-key` ($PDSERVE_ADMIN_KEY) and the
CA to trust (`--ca-cert`). Must not import torch or talk to workers or the router directly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from pdserve.core.roles import ROLES

DEFAULT_ADDRESS = "127.0.0.1:50052"
ROLE_CHOICES = ROLES


def add_parser(sub) -> argparse.ArgumentParser:
    c = sub.add_parser("ctl", help="see and steer the controller (roles, rebalance, pins, mode)")
    c.add_argument("--address", default=os.environ.get("PDSERVE_CONTROLLER_ADDRESS"),
                   help="the controller (default $PDSERVE_CONTROLLER_ADDRESS, else the one "
                        f"`pdserve serve` runs here, else {DEFAULT_ADDRESS})")
    c.add_argument("--admin-key", default=os.environ.get("PDSERVE_ADMIN_KEY"),
                   help="an admin key ($PDSERVE_ADMIN_KEY); with --ca-cert, no certificate "
                        "is needed")
    c.add_argument("--tls-dir", default=os.environ.get("PDSERVE_TLS_DIR"),
                   help="the cluster's TLS folder, to call as its operator (default "
                        "$PDSERVE_TLS_DIR, else the folder of the cluster `pdserve serve` runs "
                        "here)")
    c.add_argument("--ca-cert", default=None,
                   help="the cluster CA's certificate, to reach the controller with an admin "
                        "key and no certificate of your own")
    c.add_argument("--insecure-internal", action="store_true",
                   help="the cluster runs without internal TLS: plaintext")
    c.add_argument("--json", action="store_true", help="print JSON instead of tables")
    c.add_argument("--timeout-s", type=float, default=10.0, help="per call, drains excepted")
    cs = c.add_subparsers(dest="ctl", required=True)
    cs.add_parser("status", help="workers, roles, pressures, SLO attainment, mode")
    r = cs.add_parser("rebalance", help="flip workers to reach a split (kept until release)")
    r.add_argument("--prefill", type=int, required=True)
    r.add_argument("--decode", type=int, required=True)
    r.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    r.add_argument("--drain-timeout", type=float, default=0.0, help="seconds per flip")
    s = cs.add_parser("set-role", help="flip one worker (drain, switch, verify)")
    s.add_argument("worker")
    s.add_argument("role", choices=ROLE_CHOICES)
    s.add_argument("--drain-timeout", type=float, default=0.0)
    for name in ("pin", "unpin"):
        p = cs.add_parser(name, help=f"{name} a worker (a pinned worker is never flipped by "
                                     "the policy)")
        p.add_argument("worker")
    m = cs.add_parser("mode", help="active (acts), advisory (only advises), off")
    m.add_argument("mode", choices=("active", "advisory", "off"))
    cs.add_parser("release", help="hand the split back to the policy")
    c.set_defaults(func=run)
    return c


def run(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from pdserve import rpc
    from pdserve.proto import controller_pb2 as pb
    from pdserve.proto import controller_pb2_grpc as pb_grpc
    from pdserve.wire import role_to_proto

    meta = (("authorization", f"Bearer {args.admin_key}"),) if args.admin_key else ()
    long_s = args.timeout_s + 3600  # flips wait for drains (bounded by the drain timeout)
    try:
        ch = _channel(args)
    except (OSError, ValueError) as e:
        print(f"pdserve ctl: {e}", file=sys.stderr)
        return 2
    with ch:
        stub = pb_grpc.ControllerStub(ch)
        try:
            if args.ctl == "status":
                resp = stub.Status(pb.ControllerStatusRequest(), timeout=args.timeout_s,
                                   metadata=meta)
            elif args.ctl == "rebalance":
                resp = stub.Rebalance(pb.RebalanceRequest(
                    prefill=args.prefill, decode=args.decode, dry_run=args.dry_run,
                    drain_timeout_s=args.drain_timeout), timeout=long_s, metadata=meta)
            elif args.ctl == "set-role":
                resp = stub.SetRole(pb.ControllerSetRoleRequest(
                    address=args.worker, role=role_to_proto(args.role),
                    drain_timeout_s=args.drain_timeout), timeout=long_s, metadata=meta)
            elif args.ctl in ("pin", "unpin"):
                call = stub.Pin if args.ctl == "pin" else stub.Unpin
                resp = call(pb.PinWorkerRequest(address=args.worker), timeout=args.timeout_s,
                            metadata=meta)
            elif args.ctl == "mode":
                resp = stub.SetMode(pb.SetModeRequest(
                    mode=pb.ControllerMode.Value(f"CONTROLLER_MODE_{args.mode.upper()}")),
                    timeout=args.timeout_s, metadata=meta)
            else:
                resp = stub.Release(pb.ReleaseRequest(), timeout=args.timeout_s, metadata=meta)
        except grpc.RpcError as e:
            return _error(args, e)
    if args.json:
        print(json.dumps(MessageToDict(resp, preserving_proto_field_name=True,
                                       always_print_fields_with_no_presence=True), indent=2))
        return 0 if getattr(resp, "ok", True) and all(
            r.ok for r in getattr(resp, "results", ())) else 1
    from pdserve.controller import ctl_view

    return ctl_view.show(args.ctl, resp, dry_run=getattr(args, "dry_run", False))


def _channel(args: argparse.Namespace):
    """The channel to the controller: as the operator of a TLS folder, with an admin key
    trusting `--ca-cert`, or plaintext; the address and folder default to the cluster
    `pdserve serve` runs here."""
    import grpc

    from pdserve import rpc
    from pdserve import runfile
    from pdserve.core.identity import CONTROLLER, OPERATOR, server_name
    from pdserve.security import tls

    here = runfile.read()
    args.address = args.address or here.get("controller") or DEFAULT_ADDRESS
    if args.insecure_internal:
        tls.configure(tls.Insecure())
        return rpc.make_channel(args.address, CONTROLLER)
    if args.ca_cert and not args.tls_dir:
        with open(args.ca_cert, "rb") as f:
            ca = f.read()
        return grpc.secure_channel(args.address, grpc.ssl_channel_credentials(ca), options=[
            ("grpc.ssl_target_name_override", server_name(CONTROLLER))])
    folder = args.tls_dir or here.get("tls_dir")
    if not folder:
        raise ValueError("no credentials: give --tls-dir DIR (the cluster's TLS folder), or "
                         "--admin-key KEY with --ca-cert FILE; no `pdserve serve` runs here")
    tls.configure(tls.MutualTls(tls.TlsFolder(folder), OPERATOR))
    return rpc.make_channel(args.address, CONTROLLER)


def _error(args: argparse.Namespace, e) -> int:
    import grpc

    code = e.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and \
            "router" not in (e.details() or ""):
        msg = f"cannot reach the controller at {args.address} ({code.name}); is it running? " \
              "(--address or PDSERVE_CONTROLLER_ADDRESS)"
    else:
        msg = f"{code.name}: {e.details()}"
    if args.json:
        print(json.dumps({"error": {"code": code.name, "message": msg}}))
    else:
        print(f"pdserve ctl: {msg}", file=sys.stderr)
    return 2 if code == grpc.StatusCode.UNAVAILABLE else 1
