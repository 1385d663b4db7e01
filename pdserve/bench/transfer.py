"""`pdserve bench transfer`: progressive KV transfer over a bandwidth-limited link.

Owns one sweep: a prefill process and a decode process (each with its own `LLMEngine` on the same
model) joined by one TCP connection, over a link of a given rate; per prompt size and link rate,
four ways to move the KV: full precision after prefill (a), full precision layer by layer (b),
int8 layer by layer (c, lossy), progressive anchor-then-residual layer by layer (d). It times the
2nd and 10th output token after the end of prefill, checks (a), (b), (d) give the same tokens,
finds the link rate where (b) waits about nine decode steps after prefill, measures that point
too, and reports the aims there. The link: with root, `ip` and `tc`, two network namespaces
joined by a veth pair shaped by `tbf` on both ends; else loopback with a token-bucket pacer in the
sender (emulated; said so in the output). The processes' work is in `transfer_proc`; the table and
plot in `transfer_report`. Must not assert the aims: it reports them; only a wrong token fails.
"""

from __future__ import annotations

import argparse
import math
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.core.errors import ConfigError as BenchConfigError  # bad setting: names it
from pdserve.bench.common import number_list
from pdserve.output import emit
from pdserve.bench.transfer_proc import VARIANTS

AIMS = {"progressive_vs_layerwise_max": 0.7, "progressive_vs_after_max": 0.5,
        "progressive_vs_int8_max": 1.2}  # t_10th ratios at the nine-decode-steps link rate
NINE = 9
RESIDUAL_FRACTION_FP32 = 0.75  # residual bytes / fp32 bytes (docs/kvcodec.md)


@dataclass(frozen=True)
class TransferSettings:
    model: str
    prompt_tokens: tuple[int, ...] = (1024, 4096, 16384)
    link_gbps: tuple[float, ...] = (0.1, 0.3, 1.0, 3.0, 10.0)
    max_tokens: int = 10
    threads: int = 1
    chunk_tokens: int = 2048
    link: str = "auto"  # "auto", "shaped", "emulated"
    nine_step_point: bool = True

    def __post_init__(self) -> None:
        if not self.prompt_tokens or any(n <= 0 for n in self.prompt_tokens):
            raise BenchConfigError(f"--prompt-tokens must be positive, got {self.prompt_tokens}")
        if not self.link_gbps or any(r <= 0 for r in self.link_gbps):
            raise BenchConfigError(f"--link-gbps must be positive, got {self.link_gbps}")
        if self.max_tokens < 10:
            raise BenchConfigError(f"--max-tokens must be >= 10 (the 10th token is timed), "
                                   f"got {self.max_tokens}")
        for name in ("threads", "chunk_tokens"):
            if getattr(self, name) <= 0:
                raise BenchConfigError(f"--{name.replace('_', '-')} must be positive")
        if self.link not in ("auto", "shaped", "emulated"):
            raise BenchConfigError(f"--link must be auto, shaped or emulated, got {self.link!r}")


# ---- the link ------------------------------------------------------------------------------------
def can_shape() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "not root"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return False, f"{' and '.join(missing)} not found"
    return True, "root, ip and tc available"


def _sh(*args: str) -> None:
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")


class Link:
    """Shaped: namespaces A (prefill) and B (decode), veth pair, tbf on both ends.
    Emulated: loopback; the prefill side's sender paces its bytes."""

    def __init__(self, shaped: bool) -> None:
        self.shaped = shaped
        tag = os.getpid() % 100000
        self.ns = (f"pdxa{tag}", f"pdxb{tag}")
        self.ifs = (f"pdx{tag}a", f"pdx{tag}b")
        sub = f"10.216.{os.getpid() % 250}"
        self.ips = (f"{sub}.1", f"{sub}.2") if shaped else ("127.0.0.1", "127.0.0.1")
        self.made: list[str] = []

    def open(self) -> None:
        if not self.shaped:
            return
        for ns in self.ns:
            _sh("ip", "netns", "add", ns)
            self.made.append(ns)
        _sh("ip", "link", "add", self.ifs[0], "netns", self.ns[0], "type", "veth",
            "peer", "name", self.ifs[1], "netns", self.ns[1])
        for ns, ifc, ip in zip(self.ns, self.ifs, self.ips):
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", ifc)
            _sh("ip", "-n", ns, "link", "set", ifc, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def set_rate(self, gbps: float) -> float | None:
        """Shape both ends to `gbps`; returns the pacer's rate for the sender (emulated) or None."""
        if not self.shaped:
            return gbps
        rate_bytes = gbps * 1e9 / 8
        burst = max(64 << 10, int(rate_bytes / 250))  # at least one timer tick's worth (HZ 250)
        for ns, ifc in zip(self.ns, self.ifs):
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", ifc, "root", "tbf",
                "rate", f"{max(1, round(gbps * 1e6))}kbit", "burst", str(burst),
                "latency", "50ms")
        return None

    def prefix(self, side: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side]] if self.shaped else []

    def close(self) -> None:
        for ns in reversed(self.made):  # deleting a namespace deletes its veth end and the peer
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()


# ---- the two processes ---------------------------------------------------------------------------
class Proc:
    def __init__(self, args: list[str], log_dir: str, name: str) -> None:
        self.log = os.path.join(log_dir, f"{name}.log")
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        with open(self.log, "wb") as err:
            self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=err, text=True, env=env, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def read(self, timeout_s: float) -> dict[str, Any]:
        import json

        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            line = None
        if line is None:
            with open(self.log, encoding="utf-8", errors="replace") as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"{self.log}: no answer (exit code {self.p.poll()}):\n{tail}")
        return json.loads(line)

    def write(self, msg: dict[str, Any]) -> None:
        import json

        self.p.stdin.write(json.dumps(msg) + "\n")
        self.p.stdin.flush()

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(5)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


# ---- pure parts ----------------------------------------------------------------------------------
def decode_step_s(result: dict[str, Any]) -> float:
    """Mean decode step of a run without drafts: tokens 2..10 come one step apart."""
    t = result["token_s"]
    return (t[NINE] - t[1]) / (NINE - 1)


def make_row(res: dict[str, Any], *, prompt_tokens: int, gbps: float, reference: list[int],
             step_s: float, fp32_kv_bytes: int, nine_step_point: bool) -> dict[str, Any]:
    v = res["variant"]
    diff = sum(a != b for a, b in zip(res["tokens"], reference)) + abs(
        len(res["tokens"]) - len(reference))
    tol = max(step_s, 1e-3)
    if res["transfer_end_s"] <= tol:
        regime = "compute-bound"
    elif v == "progressive" and res["anchor_num_draft_tokens"] > 0:
        regime = "residual-overlapped"
    else:
        regime = "link-bound"
    return {
        "prompt_tokens": prompt_tokens, "link_gbps": gbps, "variant": v,
        "nine_step_point": nine_step_point,
        "t_2nd_s": res["token_s"][1], "t_10th_s": res["token_s"][NINE],
        "wait_s": res["wait_s"], "exact_kv_s": res["exact_kv_s"],
        "transfer_end_s": res["transfer_end_s"], "prefill_s": res["prefill_s"],
        "kv_bytes": res["kv_bytes"],
        "anchor_fraction": res["anchor_bytes"] / fp32_kv_bytes if res["anchor_bytes"] else None,
        "anchor_drafts": res["anchor_num_drafts"],
        "anchor_draft_tokens": res["anchor_num_draft_tokens"],
        "anchor_accepted_tokens": res["anchor_num_accepted_tokens"],
        "fallback_to_layerwise": bool(res["fallback"]), "regime": regime,
        "exact": diff == 0, "differing_tokens": diff, "tokens": res["tokens"],
    }


def nine_step_rate(points: list[tuple[float, float]], target_s: float, kv_bytes: int,
                   prefill_s: float) -> tuple[float, str]:
    """The link rate where (b)'s wait after prefill is `target_s`, from its (rate, wait) points.

    Layer-wise, the link overlaps prefill, so wait(r) = max(0, bits / r - overlap). The overlap
    is fitted on the link-bound point (wait above a tenth of the target) whose wait is nearest
    the target; with none (every point finished within prefill) it is the prefill time."""
    bits = 8 * kv_bytes
    bound = [(r, w) for r, w in points if w > 0.1 * target_s]
    if bound:
        r, w = min(bound, key=lambda p: abs(math.log(p[1] / target_s)))
        overlap, how = bits / (r * 1e9) - w, f"fitted on the {r:.3g} Gbit/s point"
    else:
        overlap, how = prefill_s, "from the prefill time (no link-bound point)"
    return bits / (max(overlap, 0.0) + target_s) / 1e9, how


def summarize(settings: TransferSettings, setup: dict[str, Any], rows: list[dict[str, Any]]
              ) -> dict[str, Any]:
    """The result document: rows, per prompt size the nine-step point and the aims there."""
    sizes = []
    for n in sorted({r["prompt_tokens"] for r in rows}):
        mine = [r for r in rows if r["prompt_tokens"] == n]
        at = {(r["link_gbps"], r["variant"]): r for r in mine if r["nine_step_point"]}
        size: dict[str, Any] = {"prompt_tokens": n, **setup["per_size"].get(str(n), {})}
        if at:
            t10 = {v: at[(g, v)]["t_10th_s"] for g, v in at}
            d = t10["progressive"]
            ratios = {"progressive_vs_layerwise": d / t10["full-layerwise"],
                      "progressive_vs_after": d / t10["full-after"],
                      "progressive_vs_int8": d / t10["int8-layerwise"]}
            size["ratios_t10"] = ratios
            size["aims_met"] = {
                "progressive_vs_layerwise": ratios["progressive_vs_layerwise"]
                <= AIMS["progressive_vs_layerwise_max"],
                "progressive_vs_after": ratios["progressive_vs_after"]
                <= AIMS["progressive_vs_after_max"],
                "progressive_vs_int8": ratios["progressive_vs_int8"]
                <= AIMS["progressive_vs_int8_max"]}
            size["nine_step_regimes"] = {v: at[(g, v)]["regime"] for g, v in at}
        sizes.append(size)
    exact = all(r["exact"] for r in rows if r["variant"] != "int8-layerwise")
    return {"bench": "transfer", "settings": {**asdict(settings),
                                              "prompt_tokens": list(settings.prompt_tokens),
                                              "link_gbps": list(settings.link_gbps)},
            **{k: v for k, v in setup.items() if k != "per_size"},
            "aims": AIMS, "rows": rows, "sizes": sizes, "exact_abd": exact}


# ---- one sweep -----------------------------------------------------------------------------------
def run_transfer_bench(s: TransferSettings, *, quick: bool = False, progress: bool = True
                       ) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from pdserve.bench.decode import make_prompts
    from pdserve.engine.loader import load_model_config

    mc = load_model_config(s.model)
    ctx = mc.max_position_embeddings
    sizes = [n for n in s.prompt_tokens if n + s.max_tokens < ctx]
    skipped = [n for n in s.prompt_tokens if n not in sizes]
    notes = [f"{n}-token prompts skipped: the model's context is {ctx} tokens "
             f"(use --model with a longer-context model)" for n in skipped]
    if not sizes:
        raise BenchConfigError(f"no prompt size fits the model's context of {ctx} tokens")
    shaped_ok, why = can_shape()
    if s.link == "shaped" and not shaped_ok:
        raise BenchConfigError(f"--link shaped needs root, ip and tc ({why})")
    shaped = shaped_ok and s.link != "emulated"
    link_note = ("shaped: two network namespaces, a veth pair, tc tbf on both ends" if shaped
                 else f"EMULATED (not shaped): loopback with a token-bucket pacer in the "
                      f"sender ({why if not shaped_ok else '--link emulated'})")
    prompts, source = make_prompts(s.model, sizes, mc.vocab_size)
    fp32_per_token = mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * 4
    link = Link(shaped)
    log_dir = tempfile.mkdtemp(prefix="pdserve-transfer-")
    procs: list[Proc] = []
    rows: list[dict[str, Any]] = []
    per_size: dict[str, Any] = {}
    n_points = len(sizes) * (len(s.link_gbps) + int(s.nine_step_point))
    bar = Progress(TextColumn("{task.description:<44}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=Console(stderr=True), disable=not progress)
    started = time.perf_counter()
    common = ["--model", s.model, "--max-prompt", str(max(sizes)), "--max-tokens",
              str(s.max_tokens), "--chunk", str(s.chunk_tokens), "--threads", str(s.threads)]
    py = [sys.executable, "-m", "pdserve.bench.transfer_proc"]
    try:
        with bar:
            task = bar.add_task("starting link and processes", total=n_points * 4 + len(sizes) + 1)
            link.open()
            link.set_rate(max(s.link_gbps))
            dec = Proc(link.prefix(1) + py + ["decode", "--listen-host", link.ips[1], *common],
                       log_dir, "decode")
            procs.append(dec)
            port = dec.read(600)["port"]
            pre = Proc(link.prefix(0) + py + ["prefill", "--connect-host", link.ips[1],
                                              "--connect-port", str(port), *common],
                       log_dir, "prefill")
            procs.append(pre)
            assert pre.read(600)["op"] == "ready"
            bar.advance(task)
            jobs = iter(range(1 << 30))

            def job(n: int, gbps: float, variant: str, **extra: Any) -> dict[str, Any]:
                pace = link.set_rate(gbps)
                pre.write({"op": "job", "rid": f"j{next(jobs)}", "variant": variant,
                           "prompt": prompts[sizes.index(n)], "max_tokens": s.max_tokens,
                           "pace_gbps": pace, **extra})
                return pre.read(3600)

            def point(n: int, gbps: float, nine: bool) -> list[dict[str, Any]]:
                got: dict[str, dict[str, Any]] = {}
                step = 0.0
                for v in VARIANTS:
                    bar.update(task, description=f"{n} tokens, {gbps:.3g} Gbit/s, {v}")
                    extra = {}
                    if v == "progressive":
                        resid = RESIDUAL_FRACTION_FP32 * fp32_per_token * n
                        extra = {"est_residual_s": 8 * resid / (gbps * 1e9), "decode_step_s": step}
                    got[v] = job(n, gbps, v, **extra)
                    if v == "full-after":
                        step = decode_step_s(got[v])
                    bar.advance(task)
                return [make_row(got[v], prompt_tokens=n, gbps=gbps,
                                 reference=got["full-after"]["tokens"], step_s=step,
                                 fp32_kv_bytes=fp32_per_token * n, nine_step_point=nine)
                        for v in VARIANTS]

            for n in sizes:
                bar.update(task, description=f"{n} tokens: warm-up job")
                job(n, max(s.link_gbps), "full-layerwise")  # untimed: first-touch allocations
                bar.advance(task)
                mine = []
                for g in s.link_gbps:
                    mine += point(n, g, nine=False)
                steps = [decode_step_s_row(r) for r in mine if r["variant"] == "full-after"]
                step_s = statistics.median(steps)
                target = NINE * step_s
                prefill_s = statistics.median(r["prefill_s"] for r in mine
                                              if r["variant"] == "full-after")
                rate, how = nine_step_rate(
                    [(r["link_gbps"], r["wait_s"]) for r in mine
                     if r["variant"] == "full-layerwise"], target, fp32_per_token * n, prefill_s)
                per_size[str(n)] = {"decode_step_s": step_s, "nine_steps_s": target,
                                    "prefill_s": prefill_s,
                                    "nine_step_gbps": rate, "nine_step_gbps_how": how}
                if s.nine_step_point:
                    mine += point(n, rate, nine=True)
                rows += mine
            bar.update(task, description="done")
        pre.write({"op": "quit"})
    except BaseException:
        print(f"pdserve bench transfer: the processes' logs are in {log_dir}", file=sys.stderr)
        raise
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    finally:
        for p in reversed(procs):
            p.stop()
        link.close()
    setup = {"model": {"path": s.model, "layers": mc.num_hidden_layers,
                       "kv_heads": mc.num_key_value_heads, "head_dim": mc.head_dim,
                       "context_tokens": ctx, "dtype": "float32"},
             "link": {"shaped": shaped, "description": link_note},
             "prompt_source": source, "notes": notes, "quick": quick,
             "machine": {"cpu_count": os.cpu_count(),
                         "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None},
             "wall_s": time.perf_counter() - started, "per_size": per_size}
    from pdserve.engine import kvcodec
    import torch

    setup["anchor_fraction_codec"] = kvcodec.anchor_fraction(torch.float32)
    return summarize(s, setup, rows)


def decode_step_s_row(row: dict[str, Any]) -> float:
    return (row["t_10th_s"] - row["t_2nd_s"]) / (NINE - 1)


# ---- CLI -----------------------------------------------------------------------------------------
QUICK = dict(prompt_tokens=(48, 96), link_gbps=(0.005, 0.05), chunk_tokens=64)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = TransferSettings(model="")
    parser.add_argument("--model", help="HF folder or .gguf file (default: SmolLM2-135M GGUF)")
    parser.add_argument("--prompt-tokens", type=number_list("--prompt-tokens", example="1024,4096"),
                        default=d.prompt_tokens,
                        help="comma-separated (default 1024,4096,16384; sizes past the model's "
                             "context are skipped and said so)")
    parser.add_argument("--link-gbps", type=number_list("--link-gbps", float, "0.1,1,10"),
                        default=d.link_gbps,
                        help="link rates to sweep, Gbit/s (default 0.1,0.3,1,3,10)")
    parser.add_argument("--link", choices=["auto", "shaped", "emulated"], default="auto",
                        help="shaped: netns + veth + tc tbf (root); emulated: loopback + pacer; "
                             "auto: shaped when possible")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--threads", type=int, default=d.threads, help="torch threads per process")
    parser.add_argument("--chunk-tokens", type=int, default=d.chunk_tokens,
                        help="prefill tokens per engine step")
    parser.add_argument("--no-nine-step-point", action="store_true",
                        help="do not measure the extra point at the nine-decode-steps rate")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.add_argument("--out", metavar="DIR", help="write DIR/results.json and DIR/transfer.png")
    parser.add_argument("--quick", action="store_true",
                        help="tiny run for tests: 48 and 96 tokens, 0.005 and 0.05 Gbit/s")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def run(args: argparse.Namespace) -> int:
    from pdserve.bench import transfer_report

    if args.model is None:
        from pdserve.engine.loader import default_model_path
        args.model = default_model_path()
    sizes = dict(prompt_tokens=args.prompt_tokens, link_gbps=args.link_gbps,
                 chunk_tokens=args.chunk_tokens)
    if args.quick:
        sizes = dict(QUICK)
    old = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum, frame):  # SIGTERM cleans up like Ctrl-C (namespaces, children)
            raise KeyboardInterrupt
        old = signal.signal(signal.SIGTERM, on_term)
    try:
        s = TransferSettings(model=args.model, max_tokens=args.max_tokens, threads=args.threads,
                             link=args.link, nine_step_point=not args.no_nine_step_point, **sizes)
        result = run_transfer_bench(s, quick=args.quick, progress=not args.no_progress)
    except BenchConfigError as e:
        print(f"pdserve bench transfer: {e}", file=sys.stderr)
        return 2
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    rc = emit(result, json_out=args.json, out_dir=args.out,
              write_outputs=transfer_report.write_outputs,
              print_tables=transfer_report.print_tables)
    if not result["exact_abd"]:
        bad = [(r["prompt_tokens"], r["link_gbps"], r["variant"]) for r in result["rows"]
               if not r["exact"] and r["variant"] != "int8-layerwise"]
        print(f"pdserve bench transfer: output differs from full-after at {bad}", file=sys.stderr)
        return 1
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(
        prog="pdserve bench transfer", description=__doc__.split("\n", 1)[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
