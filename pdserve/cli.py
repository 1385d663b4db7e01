"""The `pdserve` command: serve the embedded cluster (here, or on Ray), generate through it,
run benchmarks, simulate a cluster.

Owns argument parsing and what a person sees; the work is in the packages it calls. Must not
import torch, Ray or a benchmark module before a command that needs one runs: `pdserve --help`,
`generate`, `ctl` and a bad `serve` answer in well under a second. Benchmarks, `train-draft`
and the simulator's commands are registered by module name (`BENCHES`, `COMMANDS`, `SIM`) and
imported only when they run.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class Lazy:
    """A subcommand whose module is imported only when it runs. The module offers
    `add_arguments(parser)` and `run(args) -> int`, or, when `adder` is set, a function of that
    name that adds the subcommand (flags and `func`) to an argparse subparsers object itself."""

    module: str
    help: str
    adder: str = ""


BENCHES: dict[str, Lazy] = {
    "decode": Lazy("pdserve.bench.decode", "engine decode/prefill tokens/s vs transformers"),
    "quant": Lazy("pdserve.bench.quant", "int8 weight-only linear layers vs fp32: greedy "
                                         "agreement, logprob error, decode speed"),
    "kvstore": Lazy("pdserve.bench.kvstore",
                    "KV store put/get GB/s, batch gets, trace hit rate"),
    "route": Lazy("pdserve.bench.route", "prefix-cache hit rate and TTFT per routing policy on "
                                         "the Mooncake trace"),
    "spec": Lazy("pdserve.bench.spec", "speculative decoding speed-up and exactness per drafter "
                                       "and batch size", adder="add_spec_bench_parser"),
    "transfer": Lazy("pdserve.bench.transfer", "progressive KV transfer over a bandwidth-limited "
                                               "link (time to the 2nd and 10th token per variant)"),
    "fluid": Lazy("pdserve.bench.fluid", "the controller vs static prefill:decode splits on a "
                                         "shifting workload, repeated (SLO attainment per "
                                         "phase and its spread, goodput)"),
    "emulate": Lazy("pdserve.bench.emulate", "the control plane of emulated clusters against "
                                             "their size: CPU, memory, ticks, flips, membership"),
    "router": Lazy("pdserve.bench.router", "a router's CPU per streamed token and request, "
                                           "its rates per core, and 1..N routers"),
    "admission": Lazy("pdserve.bench.admission", "the predicted-TTFT admission past capacity: "
                                                 "admitted TTFT against its limit, raw vs "
                                                 "calibrated"),
    "chaos": Lazy("pdserve.bench.chaos", "kill -9 each process kind under streaming load: "
                                         "requests lost or changed, time to heal"),
    "migrate": Lazy("pdserve.bench.migrate", "running decodes moved live with their KV: the "
                                             "stall a client sees, in the target's decode "
                                             "steps; tokens unchanged"),
    "serve": Lazy("pdserve.bench.serve", "the serving path vs the engine's own decode rate and "
                                         "vLLM: tokens/s, TTFT, ITL per concurrency"),
    "sim": Lazy("pdserve.bench.sim", "the cluster simulator's speed: events/s and wall time "
                                     "for a 100k-request trace and 1,000 workers for an hour"),
}
SIM: dict[str, Lazy] = {
    "run": Lazy("pdserve.sim.cli_run", "simulate one cluster on a trace (real routing, "
                                       "scheduler and controller cores, modelled step times)"),
    "calibrate": Lazy("pdserve.simtools.calibrate",
                      "fit a step-time profile on this machine's engine"),
    "validate": Lazy("pdserve.simtools.validate", "replay a trace on a real cluster and in the "
                                                  "simulator; report the error"),
    "plan": Lazy("pdserve.sim.plan", "sweep prefill:decode ratios, policies and controller "
                                     "settings for a cluster size and SLO"),
}
COMMANDS: dict[str, Lazy] = {
    "train-draft": Lazy("pdserve.engine.spec.train", "train an EAGLE/DFlash/DSpark drafter for a "
                        "target by self-distillation on ShareGPT prompts",
                        adder="add_train_draft_parser"),
}


def run_lazy(prog: str, name: str, entry: Lazy, argv: list[str]) -> int:
    """Import `entry`'s module, parse `argv` with its flags, run it; its exit code."""
    try:
        module = importlib.import_module(entry.module)
    except ModuleNotFoundError as e:
        if e.name == entry.module:
            print(f"{prog} {name}: not available in this installation (module {entry.module} "
                  f"is missing)", file=sys.stderr)
        else:
            print(f"{prog} {name}: needs the Python package {e.name!r}, which is not installed "
                  f"(pip install -e '.[bench]' installs what the benchmarks use)",
                  file=sys.stderr)
        return 1
    p = argparse.ArgumentParser(prog=prog)
    sub = p.add_subparsers(dest="command", required=True)
    if entry.adder:
        getattr(module, entry.adder)(sub)
    else:
        c = sub.add_parser(name, help=entry.help, description=entry.help)
        module.add_arguments(c)
        c.set_defaults(func=module.run)
    args = p.parse_args([name, *argv])
    return args.func(args)


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
    root = None
    if args.ca_cert is not None:  # the router serves its client APIs over TLS
        with open(args.ca_cert, "rb") as f:
            root = f.read()
    with rpc.make_public_channel(args.address, root) as ch:
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
    """Every command, for parsing and --help. Light: the lazy commands are listed by name (their
    flags are `pdserve bench NAME --help`), nothing here imports torch, Ray or a benchmark."""
    from pdserve.cli_emulate import add_emulate_parser
    from pdserve.cli_serve import add_serve_parser
    from pdserve.controller import ctl
    from pdserve.deploy.ray import cli as ray_cli
    from pdserve.entrypoints import PROCESSES

    p = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_emulate_parser(sub)

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
    g.add_argument("--ca-cert", default=None,
                   help="the router's client port speaks TLS: trust this CA's certificate "
                        "('' for the system's)")
    g.set_defaults(func=cmd_generate)
    sub.add_parser("certs", help="make and renew a cluster's TLS folder (pdserve certs --help)",
                   add_help=False)  # dispatched in main()

    for kind, (_, what) in PROCESSES.items():  # dispatched in main(), listed here for --help
        sub.add_parser(kind, help=f"{what} (one process; flags: pdserve {kind} --help, or "
                                  f"PDSERVE_{kind.upper()}_<FLAG> variables)", add_help=False)
    b = sub.add_parser("bench", help="benchmarks (ratios against a baseline in the same run)",
                       description="benchmarks (ratios against a baseline in the same run); "
                                   "`pdserve bench NAME --help` for a benchmark's flags")
    bsub = b.add_subparsers(dest="bench", required=True)
    for name, entry in BENCHES.items():  # dispatched in main(); a bare name runs it too
        bsub.add_parser(name, help=entry.help, add_help=False).set_defaults(
            func=lambda args, name=name: run_lazy("pdserve bench", name, BENCHES[name], []))
    sim = sub.add_parser("sim", help="the cluster simulator: run, calibrate, validate, plan",
                         description="the cluster simulator; `pdserve sim NAME --help` for a "
                                     "subcommand's flags")
    ssub = sim.add_subparsers(dest="sim", required=True)
    for name, entry in SIM.items():  # dispatched in main()
        ssub.add_parser(name, help=entry.help, add_help=False).set_defaults(
            func=lambda args, name=name: run_lazy("pdserve sim", name, SIM[name], []))
    ctl.add_parser(sub)
    ray_cli.add_ray_parser(sub)
    for name, entry in COMMANDS.items():
        sub.add_parser(name, help=entry.help, add_help=False).set_defaults(
            func=lambda args, name=name: run_lazy("pdserve", name, COMMANDS[name], []))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from pdserve.entrypoints import PROCESSES

    if argv[:1] and argv[0] in PROCESSES:  # one process of a cluster, as a container runs it
        from pdserve.entrypoints import run

        return run(argv[0], argv[1:])
    if argv[:1] == ["certs"]:
        from pdserve.security.cli import main as certs_main

        return certs_main(argv[1:])
    if argv[:1] and argv[0] in COMMANDS:  # imported only now, with its flags
        return run_lazy("pdserve", argv[0], COMMANDS[argv[0]], argv[1:])
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in BENCHES:
        return run_lazy("pdserve bench", argv[1], BENCHES[argv[1]], argv[2:])
    if argv[:1] == ["sim"] and argv[1:2] and argv[1] in SIM:
        return run_lazy("pdserve sim", argv[1], SIM[argv[1]], argv[2:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
