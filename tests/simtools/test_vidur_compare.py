"""What the vidur comparison hands vidur and reads back, checked without vidur: the attention
profile against the roofline it is written from, the offline hub cache, the trace, the profile
derived from vidur's linear operators, and the parsing of a recorded vidur output."""

from __future__ import annotations

import csv
import json
import lzma
from pathlib import Path

import pytest

from pdserve.core.step_profile import attn_pairs
from pdserve.sim.roofline import MODELS, roofline_profile
from pdserve.sim.trace import SimRequest
from pdserve.simtools.vidur_compare import (LINEAR_OPS, dist, fit_requests, linear_times,
                                       read_vidur_metrics, vidur_args, vidur_profile)
from pdserve.simtools.vidur_inputs import (ATTENTION_COLUMNS, SNAPSHOT, attention_rows,
                                      write_hub_cache, write_trace_csv)
from pdserve.simtools.vidur_steps import STEP_CASES, profile_step_s

DATA = Path(__file__).parent / "data"
ROOF = roofline_profile("h100", "llama2-7b")
M = MODELS["llama2-7b"]


def rows_for(**kw):
    return attention_rows(ROOF, M.layers, M.hidden, M.heads, M.kv_heads, **kw)


def test_attention_rows_hold_the_roofline_per_layer_in_ms():
    rows = rows_for(max_tokens=1024, granularity=256, max_batch=8, chunk_step=256)
    assert all(set(r) == set(ATTENTION_COLUMNS) for r in rows)
    decode = {(r["batch_size"], r["kv_cache_size"]): r for r in rows if not r["is_prefill"]}
    prefill = {(r["prefill_chunk_size"], r["kv_cache_size"]): r for r in rows if r["is_prefill"]}
    assert len(decode) == 8 * 5 and len(prefill) == 4 * 5  # contexts 0, 256, ..., 1024
    d = decode[(8, 512)]
    assert d["prefill_chunk_size"] == 0 and d["time_stats.attn_prefill.median"] == ""
    # decode attention reads every context token's KV: memory-bound on the roofline
    want = ROOF.kv_read_token_s * 8 * 512 / M.layers * 1e3
    assert d["time_stats.attn_decode.median"] == pytest.approx(want, rel=1e-12)
    assert decode[(1, 0)]["time_stats.attn_decode.median"] == 0.0
    p = prefill[(1024, 256)]
    assert p["batch_size"] == 1 and p["time_stats.attn_decode.median"] == ""
    # a 1,024-token chunk on 256 tokens of context is compute-bound: pairs x FLOPs per pair
    want = ROOF.prefill_attn_s * attn_pairs(1024, 256) / M.layers * 1e3
    assert want > ROOF.kv_read_token_s * 1280 / M.layers * 1e3
    assert p["time_stats.attn_prefill.median"] == pytest.approx(want, rel=1e-12)
    assert {r["n_q_head"] for r in rows} == {32} and {r["n_kv_head"] for r in rows} == {32}
    assert {r["n_embd"] for r in rows} == {4096} and {r["block_size"] for r in rows} == {16}
    assert {r["num_tensor_parallel_workers"] for r in rows} == {1}


def test_keyed_after_the_chunk_a_prefill_row_holds_the_chunk_it_ends():
    plain = {(r["prefill_chunk_size"], r["kv_cache_size"]): r["time_stats.attn_prefill.median"]
             for r in rows_for(max_tokens=2048, granularity=256, max_batch=1, chunk_step=512)
             if r["is_prefill"]}
    after = {(r["prefill_chunk_size"], r["kv_cache_size"]): r["time_stats.attn_prefill.median"]
             for r in rows_for(max_tokens=2048, granularity=256, max_batch=1, chunk_step=512,
                               kv_includes_chunk=True) if r["is_prefill"]}
    assert after[(512, 1536)] == plain[(512, 1024)]  # 512 new tokens after 1,024 of context
    assert after[(1024, 1024)] == plain[(1024, 0)]
    assert after[(1024, 256)] == plain[(1024, 0)]  # no context before the chunk


def test_the_hub_cache_resolves_offline_as_vidur_asks_for_it(tmp_path):
    import huggingface_hub as hub  # transformers' own dependency: always installed with it
    mlp = tmp_path / "mlp.csv"
    mlp.write_text("num_tokens,time_stats.mlp_act.median\n1,0.5\n")
    rows = rows_for(max_tokens=512, granularity=256, max_batch=2, chunk_step=256)
    cache = tmp_path / "predictor"
    write_hub_cache(str(cache), "org/compute", "org/network", model="meta-llama/Llama-2-7b-hf",
                    device="h100", network_device="h100_dgx", mlp_csv=str(mlp), attention=rows)
    # vidur runs with HF_HUB_OFFLINE=1, which takes the same path as local_files_only
    comp = hub.snapshot_download(repo_id="org/compute", repo_type="dataset",
                                 cache_dir=str(cache / "profiling_data" / "compute"),
                                 local_files_only=True)
    net = hub.snapshot_download(repo_id="org/network", repo_type="dataset",
                                cache_dir=str(cache / "profiling_data" / "network"),
                                local_files_only=True)
    assert comp.endswith(SNAPSHOT) and net.endswith(SNAPSHOT)
    cfg = json.loads(Path(comp, "config.json").read_text())
    assert (cfg["model"], cfg["device_sku"]) == ("meta-llama/Llama-2-7b-hf", "h100")
    assert json.loads(Path(net, "config.json").read_text())["sku"] == "h100_dgx"
    with lzma.open(Path(comp, "mlp.csv.xz"), "rt") as f:
        assert f.read() == mlp.read_text()
    with lzma.open(Path(comp, "attention.csv.xz"), "rt") as f:
        back = list(csv.DictReader(f))
    assert len(back) == len(rows) and tuple(back[0]) == ATTENTION_COLUMNS
    assert {p.name for p in Path(net).iterdir()} == {"config.json", "all_reduce.csv.xz",
                                                       "send_recv.csv.xz"}


def test_the_trace_is_vidurs_replay_format(tmp_path):
    path = tmp_path / "t.csv"
    write_trace_csv(str(path), [SimRequest("a", 0.5, 100, 7), SimRequest("b", 1.25, 30, 1)])
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == ["Date", "Time", "PromptTokenCount", "CompletionTokenCount"]
    assert [(float(r["Time"]), int(r["PromptTokenCount"]), int(r["CompletionTokenCount"]))
            for r in rows] == [(0.5, 100, 7), (1.25, 30, 1)]
    assert len({r["Date"] for r in rows}) == 1


def test_requests_are_fitted_to_the_context_by_shortening_the_prompt():
    reqs = [SimRequest("a", 0.0, 4000, 200, tuple(range(8))), SimRequest("b", 1.0, 100, 9, (9,))]
    out, cut = fit_requests(reqs, 4096)
    assert cut == 1
    assert (out[0].prompt_tokens, out[0].output_tokens) == (3896, 200)
    assert len(out[0].block_hashes) == 8  # 3,896 tokens still span 8 blocks of 512
    assert out[1] == reqs[1]
    out, cut = fit_requests([SimRequest("c", 0.0, 10, 5000)], 4096)
    assert (out[0].prompt_tokens, out[0].output_tokens, cut) == (1, 4095, 1)


def _mlp_csv(path: Path, per_layer_ms) -> None:
    cols = ["num_tokens", "num_tensor_parallel_workers", "time_stats.emb.median",
            *[f"time_stats.{op}.median" for op in LINEAR_OPS]]
    with path.open("w") as f:
        f.write(",".join(cols) + "\n")
        for n, ms in per_layer_ms.items():
            share = [ms / len(LINEAR_OPS)] * len(LINEAR_OPS)
            f.write(",".join(map(str, [n, 1, 0.25, *share])) + "\n")
            f.write(",".join(map(str, [n, 2, 9.0, *[9.0] * len(LINEAR_OPS)])) + "\n")


def test_the_vidur_derived_profile_takes_vidurs_floor_and_slope(tmp_path):
    path = tmp_path / "mlp.csv"
    _mlp_csv(path, {1: 0.2, 64: 0.21, 512: 0.5, 1024: 1.0, 2048: 2.0})
    t = linear_times(str(path), 32)
    assert t[1] == pytest.approx((0.2 * 32 + 0.25) / 1e3)  # TP 1 rows only, + the embedding
    p = vidur_profile(str(path))
    assert p.weights_read_s == pytest.approx(0.2 * 32 / 1e3)  # no embedding: vidur sums layers
    assert p.prefill_token_s == pytest.approx(32 / 1024 / 1e3)  # ms per token over >= 512
    assert p.overhead_s == 0.0
    assert p.kv_read_token_s == ROOF.kv_read_token_s and p.prefill_attn_s == ROOF.prefill_attn_s
    assert p.origin.startswith("vidur-derived")


def test_a_recorded_vidur_output_is_read_per_request():
    got = read_vidur_metrics(str(DATA / "vidur_request_metrics.csv"), 4)
    assert got["finished"] == 4
    assert got["ttft_s"]["n"] == 4
    assert got["samples"]["ttft_s"][0] == pytest.approx(0.0345566897388801)
    assert got["samples"]["e2e_s"][1] == pytest.approx(0.4178973929487494)
    # ITL per request as ours: (e2e - TTFT) / (decode tokens - 1)
    assert got["samples"]["itl_s"][0] == pytest.approx((0.46347747237837694
                                                        - 0.0345566897388801) / 69)
    assert got["e2e_s"]["mean"] == pytest.approx(sum(got["samples"]["e2e_s"]) / 4)
    with pytest.raises(RuntimeError, match="4 requests finished, 5 were sent"):
        read_vidur_metrics(str(DATA / "vidur_request_metrics.csv"), 5)


def test_dist_of_nothing_is_empty():
    assert dist([]) == {"n": 0, "mean": None, "p50": None, "p90": None}
    assert dist([1.0, 3.0])["mean"] == 2.0


def test_vidurs_scheduler_is_set_to_our_caps():
    args = vidur_args("/w", "/w/t.csv", 6495)
    opt = dict(zip(args[::2], args[1::2]))
    assert opt["--replica_scheduler_config_type"] == "sarathi"
    assert opt["--sarathi_scheduler_config_chunk_size"] == "4096"
    assert opt["--sarathi_scheduler_config_batch_size_cap"] == "128"
    assert opt["--cache_config_num_blocks"] == "6495"
    assert opt["--replica_config_tensor_parallel_size"] == "1"
    assert opt["--replica_config_num_pipeline_stages"] == "1"
    for k in ("prefill", "decode", "time"):
        assert opt[f"--trace_request_generator_config_{k}_scale_factor"] == "1"


def test_a_step_case_costs_what_the_simulated_worker_charges():
    name, prefills, decodes = STEP_CASES[-2]
    assert prefills and decodes, name
    (c, k), = prefills
    assert profile_step_s(ROOF, prefills, decodes) == pytest.approx(
        ROOF.mixed_s(c, len(decodes), sum(decodes), prefill_cached_tokens=k), rel=1e-12)
    assert profile_step_s(ROOF, (), (1024,) * 4) == pytest.approx(ROOF.decode_s(4, 4096))
