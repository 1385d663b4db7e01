"""The `pdserve` command: serve the embedded cluster (here, or on Ray), generate through it,
run benchmarks.

Owns argument parsing and what a person sees; the work is in the packages it calls.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid


def _default_model() -> str:
    from pdserve.engine.loader import default_model_path

    return default_model_path()


def _spec_args(args: argparse.Namespace) -> dict:
    """--spec / --draft as ClusterSpec fields; a drafter's kind comes from its config.json."""
    if args.draft:
        from pdserve.engine.spec.draft_model import read_draft_kind

        kind = read_draft_kind(args.draft)
        if args.spec not in (None, kind):
            raise SystemExit(f"--spec {args.spec} does not match the drafter at --draft "
                             f"({kind})")
        return dict(spec_method=kind, draft_path=os.path.abspath(args.draft),
                    num_speculative_tokens=args.num_speculative_tokens)
    if args.spec not in (None, "ngram"):
        raise SystemExit(f"--spec {args.spec} needs --draft PATH (train one with "
                         f"`pdserve train-draft --kind {args.spec}`)")
    return dict(spec_method=args.spec or "", num_speculative_tokens=args.num_speculative_tokens)


def cmd_serve(args: argparse.Namespace) -> int:
    import logging
    import signal

    from rich.console import Console

    from pdserve import logctx
    from pdserve.controller.launcher import ClusterSpec, LocalCluster, StartCancelled

    if args.backend == "ray":  # the same processes as actors on a Ray cluster
        from pdserve.deploy.ray import cli as ray_cli

        return ray_cli.cmd_serve(args, args.model or _default_model(), _spec_args(args))
    console = Console(stderr=True)
    logctx.configure(logging.INFO)  # supervision's restarts and give-ups go to stderr
    spec = ClusterSpec(model_path=args.model or _default_model(), dtype=args.dtype, host=args.host,
                       router_port=args.port, store_port=args.store_port,
                       http_host=args.http_host, http_port=None if args.no_http else args.http_port,
                       worker_base_port=args.worker_base_port, prefill_workers=args.prefill_workers,
                       decode_workers=args.decode_workers, num_blocks=args.num_blocks,
                       ready_timeout_s=args.ready_timeout_s, log_dir=args.log_dir,
                       threads_per_worker=args.threads_per_worker, routing=args.routing,
                       controller=not args.no_controller, controller_port=args.controller_port,
                       controller_mode=args.controller_mode, ttft_slo_ms=args.ttft_slo_ms,
                       itl_slo_ms=args.itl_slo_ms, max_in_flight=args.max_in_flight,
                       api_keys_file=args.api_keys_file,
                       max_predicted_ttft_s=args.max_predicted_ttft_s,
                       shutdown_grace_s=args.shutdown_grace_s, supervise=not args.no_supervise,
                       metrics_port=args.metrics_port, **_spec_args(args))
    cluster = LocalCluster(spec)

    def on_signal(signum, frame) -> None:
        cluster.cancel.set()

    # Ctrl-C or SIGTERM, while starting or serving, stops every child in order. The children
    # run in sessions of their own: a terminal's Ctrl-C reaches only this process.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        with console.status(f"starting store, {spec.prefill_workers} prefill and "
                            f"{spec.decode_workers} decode workers, router ({spec.model_path})"):
            cluster.start()
        http = f", OpenAI API on http://{cluster.http_address}/v1" if cluster.http_address else ""
        ctl = (f", controller on {cluster.controller_address} ({spec.controller_mode}; "
               f"`pdserve ctl --address {cluster.controller_address} status`)"
               if cluster.controller_address else "")
        console.print(f"[bold green]pdserve ready[/]: gRPC on {cluster.router_address}{http}"
                      f"{ctl}, metrics on {cluster.metrics_url} (logs in {cluster.log_dir}); "
                      f"Ctrl-C stops it")
        notes = "".join(f" {k}={v}" for k, v in (("http", cluster.http_address),
                                                 ("metrics", cluster.metrics_url),
                                                 ("controller", cluster.controller_address),
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
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    from pdserve import rpc
    from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2

    sampling = common_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                         top_p=args.top_p, stop=args.stop or [])
    if args.seed is not None:
        sampling.seed = args.seed
    req = api_pb2.GenerateRequest(request_id=uuid.uuid4().hex, model=args.model or "",
                                  sampling=sampling)
    if args.chat:
        req.chat.messages.append(api_pb2.ChatMessage(role="user", content=args.prompt))
    else:
        req.prompt = args.prompt
    with rpc.make_channel(args.address) as ch:
        stub = api_pb2_grpc.GenerationStub(ch)
        try:
            for resp in stub.Generate(req, timeout=args.timeout_s):
                sys.stdout.write(resp.text)
                sys.stdout.flush()
                if resp.finish_reason:
                    u = resp.usage
                    reason = common_pb2.FinishReason.Name(resp.finish_reason)
                    print(f"\n[{reason.removeprefix('FINISH_REASON_').lower()}: "
                          f"{u.prompt_tokens} prompt tokens ({u.cached_prompt_tokens} cached), "
                          f"{u.completion_tokens} completion tokens]", file=sys.stderr)
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start the embedded cluster in the foreground")
    s.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M)")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=50051, help="router gRPC port")
    s.add_argument("--http-host", default="127.0.0.1", help="OpenAI-compatible HTTP API host")
    s.add_argument("--http-port", type=int, default=8000,
                   help="OpenAI-compatible HTTP API port (0: a free port, printed when ready)")
    s.add_argument("--no-http", action="store_true", help="serve gRPC only")
    s.add_argument("--store-port", type=int, default=None,
                   help="the store master's port (default: a free port)")
    s.add_argument("--worker-base-port", type=int, default=None,
                   help="workers listen on this port and the next ones (default: free ports)")
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
    s.add_argument("--max-in-flight", type=int, default=None,
                   help="requests the router holds at once; more get RESOURCE_EXHAUSTED / HTTP "
                        "429 (default: the router's)")
    s.add_argument("--api-keys-file", default=None,
                   help="file of 'KEY TENANT' lines the router accepts (default: no auth)")
    s.add_argument("--max-predicted-ttft-s", type=float, default=None,
                   help="the router refuses a request whose predicted time to first token is "
                        "longer (0: off; default: the router's)")
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

    g = sub.add_parser("generate", help="stream a completion from a running cluster")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--model", default=None)
    g.add_argument("--address", default="127.0.0.1:50051")
    g.add_argument("--timeout-s", type=float, default=600.0)
    g.set_defaults(func=cmd_generate)

    from pdserve.entrypoints import PROCESSES

    for kind, (_, what) in PROCESSES.items():  # dispatched in main(), listed here for --help
        sub.add_parser(kind, help=f"{what} (one process; flags: pdserve {kind} --help, or "
                                  f"PDSERVE_{kind.upper()}_<FLAG> variables)", add_help=False)
    b = sub.add_parser("bench", help="benchmarks (ratios against a baseline in the same run)")
    bsub = b.add_subparsers(dest="bench", required=True)
    from pdserve.bench import decode as bench_decode
    from pdserve.bench import kvstore as bench_kvstore
    from pdserve.bench import route as bench_route

    d = bsub.add_parser("decode", help="engine decode/prefill tokens/s vs transformers")
    bench_decode.add_arguments(d)
    d.set_defaults(func=bench_decode.run)
    k = bsub.add_parser("kvstore", help="KV store put/get GB/s, batch gets, trace hit rate")
    bench_kvstore.add_arguments(k).set_defaults(func=bench_kvstore.run)
    r = bsub.add_parser("route", help="prefix-cache hit rate and TTFT per routing policy on "
                                      "the Mooncake trace")
    bench_route.add_arguments(r).set_defaults(func=bench_route.run)
    from pdserve.bench import spec as bench_spec

    bench_spec.add_spec_bench_parser(bsub)
    from pdserve.bench import transfer as bench_transfer

    t = bsub.add_parser("transfer", help="progressive KV transfer over a bandwidth-limited link "
                                         "(time to the 2nd and 10th token per variant)")
    bench_transfer.add_arguments(t).set_defaults(func=bench_transfer.run)

    from pdserve.bench import fluid as bench_fluid

    f = bsub.add_parser("fluid", help="the controller vs static prefill:decode splits on a "
                                      "phase-shifting workload (SLO attainment, goodput)")
    bench_fluid.add_arguments(f).set_defaults(func=bench_fluid.run)
    from pdserve.bench import chaos as bench_chaos

    c = bsub.add_parser("chaos", help="kill -9 each process kind under streaming load: requests "
                                      "lost or changed, time to heal")
    bench_chaos.add_arguments(c).set_defaults(func=bench_chaos.run)
    from pdserve.controller import ctl

    ctl.add_parser(sub)
    ray_cli.add_ray_parser(sub)
    from pdserve.engine.spec import train as spec_train

    spec_train.add_train_draft_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from pdserve.entrypoints import PROCESSES

    if argv[:1] and argv[0] in PROCESSES:  # one process of a cluster, as a container runs it
        from pdserve.entrypoints import run

        return run(argv[0], argv[1:])
    if argv[:1] == ["ray"]:  # as fast as ctl: Ray is imported by the command, not the parser
        from pdserve.deploy.ray import cli as ray_cli

        p = argparse.ArgumentParser(prog="pdserve")
        ray_cli.add_ray_parser(p.add_subparsers(dest="command", required=True))
        args = p.parse_args(argv)
        return args.func(args)
    if argv[:1] == ["ctl"]:  # the operator CLI starts fast: no torch, no benchmark modules
        from pdserve.controller import ctl

        p = argparse.ArgumentParser(prog="pdserve")
        ctl.add_parser(p.add_subparsers(dest="command", required=True))
        args = p.parse_args(argv)
        return args.func(args)
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
