"""The Ray side of the `pdserve` command: `serve --backend ray` and `pdserve ray
down|status|renew-certs`.

Owns the flags (`--address`, `--cluster`, `--detach`, `--ray-*`; serve's own `--tls-dir`,
`--insecure-internal` and client-port TLS flags are read here, defined by `cli_serve`), turning
them into a `RaySpec` (errors name the flag), the ready line (the local launcher's form, plus
`backend=ray`), the foreground wait (Ctrl-C or SIGTERM tears the cluster down; `--detach`
leaves it running for `pdserve ray down`), what `pdserve ray status` prints, and `pdserve ray
renew-certs`. Must not import Ray or torch before a command runs: `pdserve --help` stays fast
where Ray is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

from pdserve.lifecycle import StopSignals

DEFAULT_CLUSTER = "default"


def add_serve_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--backend", default="local", choices=["local", "ray"],
                   help="local: child processes of this command; ray: actors on a running Ray "
                        "cluster (`ray start`), see deploy/ray/README.md")
    r = s.add_argument_group("--backend ray")
    r.add_argument("--address", default=None,
                   help="the Ray cluster (default: $RAY_ADDRESS, else the one on this machine)")
    r.add_argument("--cluster", default=DEFAULT_CLUSTER,
                   help="this pdserve cluster's name on Ray (actors pdserve-NAME-*); starting a "
                        "name again replaces what an earlier run left")
    r.add_argument("--detach", action="store_true",
                   help="return once ready and leave the cluster running (`pdserve ray down`)")
    r.add_argument("--ray-worker-cpus", type=float, default=1.0, help="CPUs per worker bundle")
    r.add_argument("--ray-worker-gpus", type=float, default=0.0,
                   help="GPUs per worker bundle (Ray's ids become its CUDA_VISIBLE_DEVICES)")
    r.add_argument("--ray-prefill-resources", default=None, metavar="JSON",
                   help='custom Ray resources per prefill worker, e.g. \'{"h100": 1}\'')
    r.add_argument("--ray-decode-resources", default=None, metavar="JSON",
                   help="custom Ray resources per decode worker")
    r.add_argument("--ray-control-cpus", type=float, default=0.5,
                   help="CPUs for each of the store master, router and controller")
    r.add_argument("--ray-control-resources", default=None, metavar="JSON",
                   help="custom Ray resources for each of them (one node: STRICT_PACK)")
    r.add_argument("--ray-store-dram-bytes", type=int, default=1 << 30,
                   help="each storage node's shared-memory segment (one per Ray node with "
                        "workers)")
    r.add_argument("--ray-dir", default="/tmp/pdserve-ray",
                   help="on every Ray node: logs, the store journal, pid files")


def ray_spec(args: argparse.Namespace, model_path: str, spec_args: dict):
    from pdserve.launcher.cluster_spec import ClusterSpec
    from pdserve.deploy.ray.plan import RaySpec, parse_resources

    for flag, value, default in (("--store-port", args.store_port, None),
                                 ("--worker-base-port", args.worker_base_port, None),
                                 ("--log-dir", args.log_dir, None)):
        if value != default:
            raise ValueError(f"{flag} is not used with --backend ray: processes bind their Ray "
                             f"node's IP on free ports there (the router's client ports: "
                             f"--host and --http-host), and log under --ray-dir")
    tls_dir, insecure = internal_tls(args)
    public_tls = {f: os.path.abspath(getattr(args, f)) if getattr(args, f, None) else ""
                  for f in ("tls_cert", "tls_key", "tls_client_ca")}  # paths on the router's node
    cluster = ClusterSpec(
        model_path=model_path, dtype=args.dtype, quantization=args.quantization,
        router_port=args.port, host=args.host, http_host=args.http_host,
        http_port=None if args.no_http else args.http_port,
        prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
        num_blocks=args.num_blocks, ready_timeout_s=args.ready_timeout_s,
        threads_per_worker=args.threads_per_worker, routing=args.routing,
        controller=not args.no_controller, controller_port=args.controller_port,
        controller_mode=args.controller_mode, ttft_slo_ms=args.ttft_slo_ms,
        itl_slo_ms=args.itl_slo_ms, max_in_flight=args.max_in_flight,
        api_keys_file=args.api_keys_file, max_predicted_ttft_s=args.max_predicted_ttft_s,
        max_local_prefill_tokens=args.max_local_prefill_tokens,
        shutdown_grace_s=args.shutdown_grace_s, supervise=not args.no_supervise,
        cluster_id=args.cluster, tls_dir=tls_dir, insecure_internal=insecure, **public_tls,
        **spec_args)
    return RaySpec(
        cluster, worker_cpus=args.ray_worker_cpus, worker_gpus=args.ray_worker_gpus,
        prefill_resources=parse_resources("--ray-prefill-resources", args.ray_prefill_resources),
        decode_resources=parse_resources("--ray-decode-resources", args.ray_decode_resources),
        control_cpus=args.ray_control_cpus,
        control_resources=parse_resources("--ray-control-resources", args.ray_control_resources),
        store_dram_bytes=args.ray_store_dram_bytes, base_dir=args.ray_dir)


def internal_tls(args: argparse.Namespace) -> tuple[str | None, bool]:
    """(the user's TLS folder or None, insecure) from `--tls-dir` / `--insecure-internal`, else
    PDSERVE_TLS_DIR / PDSERVE_INSECURE_INTERNAL, as every pdserve process reads them."""
    from pdserve.security.tls import INSECURE_ENV, TLS_DIR_ENV

    tls_dir = getattr(args, "tls_dir", None) or os.environ.get(TLS_DIR_ENV) or None
    insecure = bool(getattr(args, "insecure_internal", False)) or os.environ.get(
        INSECURE_ENV, "").lower() in ("1", "true", "yes")
    if tls_dir and insecure:
        raise ValueError(f"--tls-dir and --insecure-internal exclude each other (or "
                         f"{TLS_DIR_ENV} and {INSECURE_ENV})")
    return (os.path.abspath(tls_dir) if tls_dir else None), insecure


def tls_note(members: dict) -> str:
    """One line on the members' internal TLS: off, or when the first certificate ends."""
    if any(m.get("tls") == "insecure" for m in members.values()):
        return "internal TLS off (--insecure-internal): internal calls are plaintext"
    ends = sorted(m["cert_not_after"] for m in members.values() if m.get("cert_not_after"))
    return f"internal mutual TLS, certificates valid until {ends[0]}" if ends else ""


def cmd_serve(args: argparse.Namespace, model_path: str, spec_args: dict) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    try:
        spec = ray_spec(args, model_path, spec_args)
    except ValueError as e:
        console.print(f"[bold red]pdserve serve --backend ray[/]: {e}", soft_wrap=True)
        return 2
    from pdserve.deploy.ray import backend

    stop = threading.Event()
    try:
        backend.connect(args.address)
        if not args.detach:  # after connecting: Ray's driver sets handlers of its own
            StopSignals(stop)
        with console.status(f"starting cluster {spec.cluster_id} on Ray: store, "
                            f"{spec.cluster.prefill_workers} prefill and "
                            f"{spec.cluster.decode_workers} decode workers, router "
                            f"({spec.cluster.model_path})"):
            d = backend.up(spec, say=console.print, cancel=stop)
    except backend.StartCancelled:
        console.print("pdserve stopped while starting (everything started is gone)")
        return 0
    except Exception as e:  # no cluster, a process that failed to start: say which and why
        console.print(f"[bold red]pdserve failed to start on Ray[/]: {e}", soft_wrap=True)
        return 1
    from pdserve.deploy.ray.plan import ready_line

    scheme = "https" if spec.cluster.tls_cert else "http"
    tls = tls_note(d.members) + (f"; the CA and the operator's certificate in {d.tls_dir} "
                                 f"(`pdserve ctl --tls-dir`), `pdserve ray renew-certs "
                                 f"--cluster {d.cluster_id}` renews" if d.tls_dir else "")
    console.print(f"[bold green]pdserve ready on Ray[/] (cluster {d.cluster_id}): gRPC on "
                  f"{d.router}" + (f", OpenAI API on {scheme}://{d.http}/v1" if d.http else "")
                  + (f", controller on {d.controller}" if d.controller else "")
                  + f"; logs under {spec.base_dir}/{d.cluster_id} on each node; {tls}; "
                  + (f"`pdserve ray down --cluster {d.cluster_id}` stops it" if args.detach
                     else "Ctrl-C stops it"), soft_wrap=True)
    print(ready_line(d.router, d.http, d.controller, d.cluster_id, d.control), flush=True)
    if args.detach:
        return 0
    while not stop.wait(5.0):  # a timed wait lets the signal handler run
        if not any(g.name.endswith("-control") for g in backend.groups(d.cluster_id)):
            console.print(f"cluster {d.cluster_id} was taken down elsewhere")
            return 0
    console.print("pdserve stopping: the router finishes its requests first")
    backend.down(d.cluster_id, spec.base_dir, grace_s=spec.cluster.shutdown_grace_s)
    return 0


def add_ray_parser(sub) -> argparse.ArgumentParser:
    r = sub.add_parser("ray", help="pdserve clusters on Ray: status, down, renew-certs")
    rs = r.add_subparsers(dest="ray_command", required=True)
    for name, what in (("status", "every process of a cluster: state, pid, restarts, node"),
                       ("down", "stop a cluster: its processes, actors and placement groups")):
        p = rs.add_parser(name, help=what)
        p.add_argument("--cluster", default=None,
                       help=f"the cluster's name (default: {DEFAULT_CLUSTER}; status without "
                            f"it lists the clusters)" if name == "status" else
                            f"the cluster's name (default: {DEFAULT_CLUSTER})")
        p.add_argument("--address", default=None, help="the Ray cluster (as for serve)")
        p.add_argument("--ray-dir", default="/tmp/pdserve-ray",
                       help="where its processes' pid files are on each node")
        if name == "status":
            p.add_argument("--json", action="store_true", help="machine-readable")
        else:
            p.add_argument("--grace-s", type=float, default=30.0,
                           help="the router's time to finish requests in flight")
    p = rs.add_parser("renew-certs", help="new certificates for every process of a running "
                                          "cluster, from the driver's CA; no restart")
    p.add_argument("--cluster", default=DEFAULT_CLUSTER, help="the cluster's name")
    p.add_argument("--address", default=None, help="the Ray cluster (as for serve)")
    p.add_argument("--tls-dir", default=None,
                   help="the TLS folder the cluster was served with (default: $PDSERVE_TLS_DIR, "
                        "else this machine's folder of the cluster, made by serve)")
    p.add_argument("--lifetime-s", type=float, default=None,
                   help="the new certificates' lifetime when the folder holds the CA's key "
                        "(default: 30 days)")
    r.set_defaults(func=cmd_ray)
    return r


def cmd_ray(args: argparse.Namespace) -> int:
    from pdserve.deploy.ray import backend
    from pdserve.deploy.ray.plan import STATUS_COLUMNS

    try:
        backend.connect(args.address)
    except backend.NoRayCluster as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.ray_command == "renew-certs":
        return renew_certs(args)
    if args.ray_command == "down":
        name = args.cluster or DEFAULT_CLUSTER
        found = backend.down(name, args.ray_dir, grace_s=args.grace_s)
        print(f"cluster {name}: stopped {found['actors']} actors, removed "
              f"{found['placement_groups']} placement groups, swept "
              f"{found['stray_processes']} processes whose actor was gone")
        return 0
    if args.cluster is None and not args.json:
        names = backend.clusters()
        print("pdserve clusters on this Ray cluster: " + (", ".join(names) or "none"))
        if DEFAULT_CLUSTER not in names:
            return 0
    name = args.cluster or DEFAULT_CLUSTER
    rows, live = backend.status(name)
    if args.json:
        print(json.dumps({"cluster": name, "rows": [dict(zip(STATUS_COLUMNS, r)) for r in rows],
                          "members": live}, indent=1))
        return 0
    if not rows:
        print(f"cluster {name}: nothing on this Ray cluster")
        return 0
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(STATUS_COLUMNS)]
    print(f"cluster {name}")
    for r in [STATUS_COLUMNS, *rows]:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    note = tls_note(live)
    if note:
        renews = any(m.get("cert_not_after") for m in live.values())
        print(note + (f" (`pdserve ray renew-certs --cluster {name}` renews them)" if renews
                      else ""))
    return 0


def renew_certs(args: argparse.Namespace) -> int:
    from pdserve.deploy.ray import backend, certs
    from pdserve.security.pki import PkiError

    _, live = backend.status(args.cluster)
    if any(m.get("tls") == "insecure" for m in live.values()):
        print(f"error: cluster {args.cluster} runs with --insecure-internal: it has no "
              f"certificates to renew", file=sys.stderr)
        return 1
    try:
        tls_dir, _ = internal_tls(args)
        issuer = certs.issuer(args.cluster, tls_dir, args.lifetime_s or certs.LIFETIME_S,
                              make=False)
        done = backend.renew_certs(args.cluster, issuer)
    except (ValueError, PkiError) as e:  # CertError, PkiError: the folder named
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not done:
        print(f"cluster {args.cluster}: nothing on this Ray cluster", file=sys.stderr)
        return 1
    for member, end in sorted(done.items()):
        print(f"{member}: " + (end if end.startswith("error") else f"valid until {end}"))
    return 1 if any(end.startswith("error") for end in done.values()) else 0
