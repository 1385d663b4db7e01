"""How `pdserve ctl` shows the controller's answers as rich tables.

Owns layout only: columns, colours, the one-line summaries. Must not call anything.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

_ROLE = {0: "-", 1: "prefill", 2: "decode"}
_MODE = {0: "?", 1: "active", 2: "advisory", 3: "off"}
_STATE_STYLE = {"serving": "green", "draining": "yellow", "switching": "yellow",
                "failed": "red", "gone": "red"}


def _age(s: float) -> str:
    if s < 0:
        return "never"
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago"


def show(command: str, resp, dry_run: bool = False) -> int:
    # Piped or captured output gets rich's 80 columns, too narrow for the worker table.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    if command == "status":
        return _status(console, resp)
    if command == "rebalance":
        t = Table(title="rebalance plan" + (" (dry run: nothing changed)" if dry_run else ""))
        for col in ("#", "worker", "from", "to", "result"):
            t.add_column(col, no_wrap=col == "worker")
        results = {r.address: r for r in resp.results}
        for i, f in enumerate(resp.plan, 1):
            r = results.get(f.address)
            res = "" if r is None else (f"[green]ok[/] {r.seconds:.2f}s" if r.ok
                                        else f"[red]failed[/] {r.error}")
            t.add_row(str(i), f.address, _ROLE[f.from_role], _ROLE[f.to_role], res)
        console.print(t if resp.plan else "already at that split: nothing to flip")
        return 0 if all(r.ok for r in resp.results) else 1
    if command == "set-role":
        if resp.ok:
            console.print(f"{resp.address}: {_ROLE[resp.from_role]} -> {_ROLE[resp.to_role]} "
                          f"in {resp.seconds:.2f}s ({resp.drained_requests} drained)")
            return 0
        console.print(f"[red]{resp.address}: flip to {_ROLE[resp.to_role]} failed[/]: "
                      f"{resp.error}; the worker is out of both pools until re-admitted")
        return 1
    if command in ("pin", "unpin"):
        console.print(f"{resp.address}: {'pinned' if resp.pinned else 'unpinned'}")
        return 0
    if command == "mode":
        console.print(f"mode: {_MODE[resp.previous]} -> {_MODE[resp.mode]}")
        return 0
    console.print("target released: the policy steers the split again" if resp.had_target
                  else "no target stood")
    return 0


def _status(console: Console, s) -> int:
    t = Table(title=f"pdserve controller: mode {_MODE[s.mode]}")
    t.add_column("worker", no_wrap=True)  # an address must stay copyable
    for col in ("role", "state", "pinned", "running", "waiting", "KV used", "in flight",
                "offload budget", "switches", "last flip"):
        t.add_column(col)
    for w in s.workers:
        kv = f"{w.kv_used_blocks}/{w.kv_total_blocks}" if w.kv_total_blocks else "-"
        style = _STATE_STYLE.get(w.state, "")
        flip = _age(w.last_flip_age_s) + (f" ({w.last_flip_reason})" if w.last_flip_reason
                                          else "")
        budget = (f"{w.offload_in_flight_tokens}/{w.offload_budget_tokens}"
                  if w.offload_budget_tokens else "-")
        t.add_row(w.address, _ROLE[w.role], f"[{style}]{w.state}[/]" if style else w.state,
                  "yes" if w.pinned else "", str(w.running), str(w.waiting), kv,
                  str(w.in_flight), budget, str(w.role_switches), flip)
    console.print(t)
    att = "n/a" if s.slo_attainment < 0 else f"{100 * s.slo_attainment:.0f}%"
    console.print(f"pressure: prefill {s.prefill_pressure:.2f} ({s.prefill_work_s:.2f}s of "
                  f"queued work), decode {s.decode_pressure:.2f}  (1.00 = at the SLO share)")
    console.print(f"last {s.window_s:.0f}s: {s.window_requests} requests, SLO attainment {att} "
                  f"(TTFT p90 {1000 * s.ttft_p90_s:.0f} ms / SLO {1000 * s.ttft_slo_s:.0f} ms, "
                  f"ITL p90 {1000 * s.itl_p90_s:.0f} ms / SLO {1000 * s.itl_slo_s:.0f} ms)")
    if s.has_target:
        console.print(f"operator target: {s.target_prefill} prefill : {s.target_decode} decode "
                      "(holds until `pdserve ctl release`)")
    if s.last_action:
        reason = s.last_reason if s.last_reason.startswith(s.last_action) else \
            f"{s.last_action}: {s.last_reason}"
        console.print(f"last decision: {reason}")
    for c in s.conflicts:
        console.print(f"[yellow]conflict:[/] {c}")
    return 0
