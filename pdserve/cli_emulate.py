"""`pdserve emulate`: a whole cluster whose workers run the emulated engine, for load and scale.

Owns the command's own flags (how many workers, how many of them prefill, the step-time
profile, the KV scale) on top of `pdserve serve`'s, which it is otherwise: the same launcher,
supervision, router, store and controller (`launcher/local.py`). Each worker is a process of
its own, as in a real deployment, so that the router's fan-out, the store master's clients and
the controller's polls are exactly a real cluster's; an emulated worker loads no torch and no
weights. Must not start anything itself: `cli_serve` does.
"""

from __future__ import annotations

import argparse
import sys

from pdserve.cli_serve import _positive_int, _serve_local, add_serve_parser, passthrough_args

DEFAULT_PROFILE = "h100-llama3-8b"
DEFAULT_KV_SCALE = 1 / 64  # an 8B model's 128 KiB a token: 32 KiB blocks of 16 tokens


def add_emulate_parser(sub) -> argparse.ArgumentParser:
    e = add_serve_parser(sub, "emulate", "start a cluster of emulated workers (a load and scale "
                         "tool: steps timed by a profile, deterministic tokens, no weights)")
    g = e.add_argument_group("emulation (these set the pools: --prefill-workers and "
                             "--decode-workers are ignored)")
    g.add_argument("--workers", type=_positive_int, required=True, help="workers in all")
    g.add_argument("--prefill", type=_positive_int, default=None,
                   help="how many of them prefill (default: a quarter, at least 1)")
    g.add_argument("--profile", default=DEFAULT_PROFILE,
                   help=f"the step-time profile: a shipped name or a JSON file (default "
                        f"{DEFAULT_PROFILE})")
    g.add_argument("--kv-scale", type=float, default=DEFAULT_KV_SCALE,
                   help="KV bytes per token as a fraction of the profile's, in (0, 1] "
                        "(default 1/64)")
    e.set_defaults(func=cmd_emulate)
    return e


def cmd_emulate(args: argparse.Namespace) -> int:
    from pdserve.core.errors import ConfigError
    from pdserve.core.step_profile import load_profile
    from pdserve.engine.emulated import kv_block_bytes
    from pdserve.engine.model_files import default_model_path

    from pdserve.launcher.cluster_spec import ClusterSpec, emulated_pools

    if args.backend != "local":
        print("pdserve emulate: error: emulated clusters run on this host (--backend local)",
              file=sys.stderr)
        return 2
    try:
        args.prefill_workers, args.decode_workers = emulated_pools(args.workers, args.prefill)
        block = kv_block_bytes(load_profile(args.profile), ClusterSpec.block_size_tokens,
                               args.kv_scale)
    except (ValueError, ConfigError) as e:
        print(f"pdserve emulate: error: {e}", file=sys.stderr)
        return 2
    print(f"pdserve emulate: {args.prefill_workers} prefill and {args.decode_workers} decode "
          f"workers on profile {args.profile}; KV blocks of {block} bytes ({args.kv_scale:g} of "
          f"the profile's size)", file=sys.stderr, flush=True)
    extra = {**passthrough_args(args), "engine": "emulated", "profile": args.profile,
             "kv_scale": args.kv_scale}
    return _serve_local(args, args.model or default_model_path(), extra)
