"""`pdserve serve`: its flags, the checks made before any process starts, and the foreground run.

Owns turning the flags into a `ClusterSpec` (router admission and key flags travel as
`router_settings` / `controller_settings`), refusing bad input in one line that names the flag
before anything is started (a model path that is not a model, a key file that does not load), and what
a person sees while the cluster starts, serves and stops. Must not import torch: the checks run
in a fraction of a second, and the model is loaded by the workers, not by this process.
"""

from __future__ import annotations

import argparse
import os
import sys


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _nonneg_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _nonneg_float(text: str) -> float:
    v = float(text)
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def add_serve_parser(sub, name: str = "serve",
                     help: str = "start the embedded cluster in the foreground"
                     ) -> argparse.ArgumentParser:
    s = sub.add_parser(name, help=help)
    s.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M)")
    s.add_argument("--device", default="auto", metavar="auto|cpu|cuda|cuda:N",
                   help="where the workers compute (auto: one GPU per worker when GPUs are "
                        "visible, else the CPU; cuda: one distinct GPU per worker; cuda:N: "
                        "every worker on GPU N, counted within CUDA_VISIBLE_DEVICES)")
    s.add_argument("--share-gpus", action="store_true",
                   help="allow more workers than visible GPUs (workers go round-robin over them)")
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bfloat16 on a GPU, float32 on the CPU")
    s.add_argument("--quantization", default="none", choices=["none", "int8"],
                   help="int8: the workers' projection weights int8 per output channel, "
                        "activations fp32 (CPU and float32 only; costs some accuracy: "
                        "`pdserve bench quant`; default none)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=50051,
                   help="router gRPC port (0: a free port, printed when ready)")
    s.add_argument("--http-host", default="127.0.0.1", help="OpenAI-compatible HTTP API host")
    s.add_argument("--http-port", type=int, default=8000,
                   help="OpenAI-compatible HTTP API port (0: a free port, printed when ready)")
    s.add_argument("--no-http", action="store_true", help="serve gRPC only")
    s.add_argument("--store-port", type=int, default=None,
                   help="the store master's port (default: a free port)")
    s.add_argument("--worker-base-port", type=int, default=None,
                   help="workers listen on this port and the next ones (default: free ports)")
    s.add_argument("--routers", type=_positive_int, default=1,
                   help="routers serving the same client ports (SO_REUSEPORT: the kernel "
                        "spreads connections among them; each one's death costs only its own "
                        "streams, which clients retry on the others)")
    s.add_argument("--prefill-workers", type=int, default=1)
    s.add_argument("--decode-workers", type=int, default=1)
    s.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per worker")
    s.add_argument("--routing", default="auto",
                   choices=["auto", "round_robin", "least_loaded", "power_of_two", "kv_aware"],
                   help="prefill routing policy (auto: kv_aware with 2+ prefill workers, "
                        "else round_robin)")
    s.add_argument("--spec", default=None, choices=["ngram", "eagle", "dflash", "dspark"],
                   help="speculative decoding on the decode workers (default: off); the "
                        "trained drafters need --draft")
    s.add_argument("--draft", default=None, metavar="PATH",
                   help="a drafter from `pdserve train-draft` (implies --spec of its kind)")
    s.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="most draft tokens per request per step (gamma)")
    s.add_argument("--threads-per-worker", type=int, default=None,
                   help="compute threads per worker (default: this machine's cores split evenly)")
    s.add_argument("--no-share-cores", action="store_true",
                   help="CPU workers keep to their own threads (default: a step also uses the "
                        "cores the host's other workers idle at the moment)")
    s.add_argument("--core-sharing", choices=("lend", "turns"), default="lend",
                   help="how CPU workers share the host's cores: lend (a step runs on its own "
                        "share plus the cores the others idle, beside their steps; the "
                        "default) or turns (a step runs on all of them, one worker's step at a "
                        "time: more tokens/s for bursts, slower tokens under steady traffic)")
    s.add_argument("--no-controller", action="store_true",
                   help="start no controller: roles stay as started")
    s.add_argument("--controller-port", type=int, default=None,
                   help="the controller's gRPC port (`pdserve ctl --address`; default: a free "
                        "port, printed when ready)")
    s.add_argument("--controller-mode", default="active", choices=["active", "advisory", "off"],
                   help="active: flips roles and offloads prefill; advisory: only decides, "
                        "logs and exports; off")
    s.add_argument("--ttft-slo-ms", type=float, default=2000.0,
                   help="time-to-first-token SLO the controller steers for")
    s.add_argument("--itl-slo-ms", type=float, default=200.0,
                   help="inter-token latency SLO the controller steers for")
    a = s.add_argument_group("admission and keys (the router's)")
    a.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id /v1/models lists and clients send (default: the model's "
                        "file or folder name; that name and its stem are accepted too)")
    a.add_argument("--max-in-flight", type=_positive_int, default=None,
                   help="requests the router holds at once; more get RESOURCE_EXHAUSTED / HTTP "
                        "429 (default: the router's, 128)")
    a.add_argument("--max-in-flight-per-tenant", type=_nonneg_int, default=None,
                   help="requests one tenant (API key) may hold at once (0: no bound, the "
                        "default)")
    a.add_argument("--tenant-rate-rps", type=_nonneg_float, default=None,
                   help="requests per second one tenant may start (0: no limit, the default)")
    a.add_argument("--tenant-burst", type=_positive_int, default=None,
                   help="requests a tenant may start at once above its rate (default 8)")
    a.add_argument("--max-predicted-ttft-s", type=_nonneg_float, default=None,
                   help="the router refuses a request whose predicted time to first token is "
                        "longer (0: off; default: the router's, 10)")
    a.add_argument("--max-local-prefill-tokens", type=_nonneg_int, default=None,
                   help="a prompt a decode worker caches all but at most this many tokens of "
                        "is prefilled and decoded there, skipping the prefill worker and the "
                        "store (0: off; default: the router's, 64)")
    a.add_argument("--api-keys-file", default=None,
                   help="file of 'KEY TENANT' lines the router accepts; PDSERVE_API_KEYS="
                        "KEY:TENANT,... adds more (default: no auth)")
    a.add_argument("--admin-keys-file", default=None,
                   help="file of 'KEY [NAME]' lines: keys that may steer the cluster without "
                        "its operator certificate (the controller, `pdserve ctl --admin-key`, "
                        "and the router's control API; default: none)")
    t = s.add_argument_group("TLS")
    t.add_argument("--tls-dir", default=None,
                   help="the cluster's TLS folder (a CA and a certificate per component; "
                        "`pdserve certs init DIR`); default: a new CA made at start in the log "
                        "folder and renewed while serving")
    t.add_argument("--insecure-internal", action="store_true",
                   help="no TLS inside the cluster: internal calls in plaintext, "
                        "unauthenticated (only on a network you trust)")
    t.add_argument("--tls-cert", default=None, help="serve the client APIs (gRPC and HTTP) "
                                                    "over TLS with this certificate")
    t.add_argument("--tls-key", default=None, help="the private key of --tls-cert")
    t.add_argument("--tls-client-ca", default=None,
                   help="require client certificates from this CA on the client APIs")
    a.add_argument("--allow-special-tokens-in-messages", action="store_true",
                   help="text in chat messages that spells a control token (e.g. <|im_start|>) "
                        "becomes that token (default: encoded as text)")
    s.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM or Ctrl-C the router stops admitting and gives requests in "
                        "flight this long to finish before the rest stops (default 30)")
    s.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus /metrics of this launcher: restarts and liveness of its "
                        "processes (default 0: a free port, printed when ready)")
    s.add_argument("--no-supervise", action="store_true",
                   help="do not restart a process that dies")
    s.add_argument("--ready-timeout-s", type=float, default=300.0)
    s.add_argument("--log-dir", default=None)
    from pdserve.deploy.ray import cli as ray_cli

    ray_cli.add_serve_flags(s)
    s.set_defaults(func=cmd_serve)
    return s


def passthrough_args(args: argparse.Namespace) -> dict[str, dict]:
    """The router and controller settings given, as ClusterSpec `router_settings` /
    `controller_settings` (`RouterConfig` / `ControllerConfig` fields; flags left unset keep
    the processes' own defaults)."""
    router = {name: value for name, value in (
        ("model_name", args.served_model_name),
        ("max_in_flight_per_tenant", args.max_in_flight_per_tenant),
        ("tenant_rate_rps", args.tenant_rate_rps),
        ("tenant_burst", args.tenant_burst)) if value is not None}
    if args.allow_special_tokens_in_messages:
        router["allow_special_tokens_in_messages"] = True
    controller = {}
    if args.admin_keys_file:
        router["admin_keys_file"] = controller["admin_keys_file"] = os.path.abspath(
            args.admin_keys_file)
    if args.api_keys_file:  # tenant keys are told apart from others: PERMISSION_DENIED
        controller["api_keys_file"] = os.path.abspath(args.api_keys_file)
    return {"router_settings": router, "controller_settings": controller}


def input_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, in one line naming the flag, before anything starts; None
    when nothing is. The model is checked here only for the local backend (with Ray it is a
    path on the Ray nodes)."""
    from pdserve.engine.model_files import ModelNotFoundError, default_model_path, \
        model_path_problem

    if args.model is not None and args.backend == "local":
        problem = model_path_problem(args.model)
        if problem:
            return f"--model {problem}"
    if args.model is None:
        try:
            default_model_path()
        except ModelNotFoundError as e:
            return f"{e} (or pass --model PATH)"
    if args.draft is not None and not os.path.isdir(args.draft):
        return f"--draft {args.draft}: no such folder (train one with `pdserve train-draft`)"
    from pdserve.security.tenants import ApiKeys
    from pdserve.security.keys import AdminKeys, KeyFileError

    for flag, path, load in (("--api-keys-file", args.api_keys_file, ApiKeys.load),
                             ("--admin-keys-file", args.admin_keys_file, AdminKeys.load)):
        if path is None:
            continue
        try:
            load(path)
        except OSError as e:
            return f"{flag} {path}: {e.strerror}"
        except KeyFileError as e:
            return f"{flag}: {e}"
    problem = tls_problem(args)
    if problem:
        return problem
    from pdserve.engine.device import DeviceError, check_quantization

    try:
        check_quantization(args.quantization, args.device, args.dtype)
    except DeviceError as e:
        return str(e)
    if args.backend == "local":
        return device_problem(args)
    return None


def tls_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the TLS flags, naming the flag; None when nothing is."""
    if args.tls_dir and args.insecure_internal:
        return "--tls-dir and --insecure-internal exclude each other"
    if args.tls_dir:
        from pdserve.core.identity import KINDS
        from pdserve.security import pki, tls

        folder = tls.TlsFolder(args.tls_dir)
        try:
            for kind in KINDS:  # every process of the cluster starts from this folder
                folder.material(kind)
        except pki.PkiError as e:
            return f"--tls-dir: {e}"
    if bool(args.tls_cert) != bool(args.tls_key):
        return "--tls-cert and --tls-key: give both or neither"
    if args.tls_client_ca and not args.tls_cert:
        return "--tls-client-ca needs --tls-cert and --tls-key"
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                       ("--tls-client-ca", args.tls_client_ca)):
        if path and not os.path.isfile(path):
            return f"{flag} {path}: no such file"
    return None


def device_problem(args: argparse.Namespace) -> str | None:
    """Whether this host's GPUs (listed without torch) can hold the workers `--device` asks
    for; the message names the flag."""
    from pdserve.engine.device import (DeviceError, check_quantization, plan_worker_devices,
                                       visible_gpus)

    try:
        devices = plan_worker_devices(args.device, args.prefill_workers + args.decode_workers,
                                      visible_gpus(), share=args.share_gpus)
        for device in {args.device, *devices}:
            check_quantization(args.quantization, device, args.dtype)
    except DeviceError as e:
        return str(e)
    return None


def _spec_args(args: argparse.Namespace) -> dict:
    """--spec / --draft as ClusterSpec fields; a drafter's kind comes from its config.json."""
    if args.draft:
        from pdserve.core.draft_config import read_draft_kind

        try:
            kind = read_draft_kind(args.draft)
        except ValueError as e:
            raise SystemExit(f"pdserve serve: --draft {e}") from None
        if args.spec not in (None, kind):
            raise SystemExit(f"pdserve serve: --spec {args.spec} does not match the drafter at "
                             f"--draft ({kind})")
        return dict(spec_method=kind, draft_path=os.path.abspath(args.draft),
                    num_speculative_tokens=args.num_speculative_tokens)
    if args.spec not in (None, "ngram"):
        raise SystemExit(f"pdserve serve: --spec {args.spec} needs --draft PATH (train one with "
                         f"`pdserve train-draft --kind {args.spec}`)")
    return dict(spec_method=args.spec or "", num_speculative_tokens=args.num_speculative_tokens)


def cmd_serve(args: argparse.Namespace) -> int:
    problem = input_problem(args)
    if problem:
        print(f"pdserve serve: error: {problem}", file=sys.stderr)
        return 2
    from pdserve.engine.model_files import default_model_path

    model = args.model or default_model_path()
    extra = {**_spec_args(args), **passthrough_args(args)}
    if args.backend == "ray":  # the same processes as actors on a Ray cluster
        from pdserve.deploy.ray import cli as ray_cli

        return ray_cli.cmd_serve(args, model, extra)
    return _serve_local(args, model, extra)


def _serve_local(args: argparse.Namespace, model: str, extra: dict) -> int:
    import logging

    from rich.console import Console

    from pdserve import logctx
    from pdserve import runfile
    from pdserve.launcher.local import ClusterSpec, LocalCluster, StartCancelled
    from pdserve.lifecycle import StopSignals

    console = Console(stderr=True)
    logctx.configure(logging.INFO)  # supervision's restarts and give-ups go to stderr
    spec = ClusterSpec(model_path=model, dtype=args.dtype, quantization=args.quantization,
                       device=args.device,
                       share_gpus=args.share_gpus, host=args.host,
                       router_port=args.port, routers=args.routers, store_port=args.store_port,
                       http_host=args.http_host, http_port=None if args.no_http else args.http_port,
                       worker_base_port=args.worker_base_port, prefill_workers=args.prefill_workers,
                       decode_workers=args.decode_workers, num_blocks=args.num_blocks,
                       ready_timeout_s=args.ready_timeout_s, log_dir=args.log_dir,
                       threads_per_worker=args.threads_per_worker,
                       share_cores=not args.no_share_cores, core_sharing=args.core_sharing,
                       routing=args.routing,
                       controller=not args.no_controller, controller_port=args.controller_port,
                       controller_mode=args.controller_mode, ttft_slo_ms=args.ttft_slo_ms,
                       itl_slo_ms=args.itl_slo_ms, max_in_flight=args.max_in_flight,
                       api_keys_file=args.api_keys_file,
                       max_predicted_ttft_s=args.max_predicted_ttft_s,
                       max_local_prefill_tokens=args.max_local_prefill_tokens,
                       shutdown_grace_s=args.shutdown_grace_s, supervise=not args.no_supervise,
                       metrics_port=args.metrics_port, tls_dir=args.tls_dir,
                       insecure_internal=args.insecure_internal,
                       tls_cert=args.tls_cert or "", tls_key=args.tls_key or "",
                       tls_client_ca=args.tls_client_ca or "", **extra)
    cluster = LocalCluster(spec)

    # Ctrl-C or SIGTERM, while starting or serving, stops every child in order. The children
    # run in sessions of their own: a terminal's Ctrl-C reaches only this process.
    StopSignals(cluster.cancel)
    try:
        with console.status(f"starting store, {spec.prefill_workers} prefill and "
                            f"{spec.decode_workers} decode workers, router ({spec.model_path})"):
            cluster.start()
        scheme = "https" if spec.tls_cert else "http"
        http = (f", OpenAI API on {scheme}://{cluster.http_address}/v1"
                if cluster.http_address else "")
        ctl = (f", controller on {cluster.controller_address} ({spec.controller_mode}; "
               f"`pdserve ctl status`)" if cluster.controller_address else "")
        tls_note = ("internal TLS off (--insecure-internal)" if cluster.security.insecure else
                    f"internal mutual TLS, certificates in {cluster.security.folder.path}")
        runfile.write({"cluster_id": cluster.cluster_id, "router": cluster.router_address,
                       "router_control": cluster.router_control_address,
                       "controller": cluster.controller_address or "",
                       "tls_dir": "" if cluster.security.insecure
                       else cluster.security.folder.path, "pid": os.getpid()})
        console.print(f"[bold green]pdserve ready[/]: gRPC on {cluster.router_address}{http}"
                      f"{ctl}, metrics on {cluster.metrics_url} (logs in {cluster.log_dir}; "
                      f"{tls_note}); Ctrl-C stops it")
        notes = "".join(f" {k}={v}" for k, v in (("http", cluster.http_address),
                                                 ("metrics", cluster.metrics_url),
                                                 ("controller", cluster.controller_address),
                                                 ("control", cluster.router_control_address),
                                                 ("cluster", cluster.cluster_id)) if v)
        print(f"pdserve ready on {cluster.router_address}{notes}", flush=True)
        while not cluster.cancel.wait(0.5):  # a timed wait lets the signal handler run
            pass
        console.print("pdserve stopping: the router finishes its requests first")
    except StartCancelled:
        console.print("pdserve stopped while starting")
    except Exception as e:  # a child failed to start, or a port is taken: say which and why
        console.print(f"[bold red]pdserve failed to start[/]: {e}", soft_wrap=True)
        return 1
    finally:
        cluster.stop()
        runfile.remove(cluster.cluster_id)
    return 0
