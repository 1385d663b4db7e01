"""`pdserve bench decode --quick` on the tiny random Llama: the document's shape and arithmetic.

Speed is never asserted here (the machines are shared); only that every figure is present,
positive, and that the ratios are the quotients of the figures they are built from.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from pdserve.bench import decode as bench


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def test_quick_json_document(tiny_llama_dir: str, tmp_path, capsys) -> None:
    out_dir = tmp_path / "out"
    threads = torch.get_num_threads()
    # One thread: on a shared 2-core box two threads stall each other at every op, and the
    # quick run's tiny timings would drown in it. The CLI puts the thread count back.
    rc = bench.main(["--model", tiny_llama_dir, "--quick", "--json", "--out", str(out_dir),
                     "--no-progress", "--threads", "1"])
    assert rc == 0
    assert torch.get_num_threads() == threads
    stdout = capsys.readouterr().out
    doc = json.loads(stdout)  # stdout is exactly one JSON document
    with open(out_dir / "decode.json", encoding="utf-8") as f:
        assert json.load(f) == doc
    png = out_dir / "decode.png"
    assert png.stat().st_size > 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    q = bench.QUICK
    assert doc["bench"] == "decode"
    assert doc["machine"]["cpu_count"] >= 1 and doc["machine"]["torch_threads"] >= 1
    assert doc["model"] == {"path": tiny_llama_dir, "dtype": "float32", "quantization": "none",
                            "weight_bytes": doc["model"]["weight_bytes"]}
    assert _positive(doc["model"]["weight_bytes"])
    st = doc["settings"]
    assert st["batch_sizes"] == list(q.batch_sizes)
    assert (st["prompt_tokens"], st["new_tokens"], st["prefill_tokens"], st["repeats"]) == \
        (q.prompt_tokens, q.new_tokens, q.prefill_tokens, q.repeats)
    assert st["prompt_source"] in ("sharegpt", "random")

    bw = doc["bandwidth"]
    assert all(_positive(t) for t in bw["copy_s"])
    assert bw["bytes_per_s"] == pytest.approx(2 * bw["copy_bytes"] / min(bw["copy_s"]))

    assert [r["batch_size"] for r in doc["decode"]] == list(q.batch_sizes)
    for r in doc["decode"]:
        b, eng, hf = r["batch_size"], r["engine"], r["transformers"]
        assert len(eng["decode_s"]) == len(hf["generate_s"]) == len(hf["generate_one_s"]) == q.repeats
        for x in (*eng["decode_s"], *hf["generate_s"], *hf["generate_one_s"], *hf["decode_s"],
                  eng["tokens_per_s"], hf["tokens_per_s"], r["ratio"], r["bound_tokens_per_s"],
                  r["engine_fraction_of_bound"]):
            assert _positive(x)
        assert hf["decode_s"] == pytest.approx(
            [f - o for f, o in zip(hf["generate_s"], hf["generate_one_s"])])
        assert eng["tokens_per_s"] == pytest.approx(b * q.new_tokens / eng["median_s"])
        assert hf["tokens_per_s"] == pytest.approx(b * q.new_tokens / hf["median_s"])
        assert r["ratio"] == pytest.approx(eng["tokens_per_s"] / hf["tokens_per_s"])
        assert r["bound_tokens_per_s"] == pytest.approx(
            b * bw["bytes_per_s"] / doc["model"]["weight_bytes"])
        assert r["engine_fraction_of_bound"] == pytest.approx(
            eng["tokens_per_s"] / r["bound_tokens_per_s"])

    p = doc["prefill"]
    assert p["prompt_tokens"] == q.prefill_tokens
    assert p["max_num_batched_tokens"] >= q.prefill_tokens
    assert p["engine_steps"] == [1] * q.repeats  # no chunking: the whole prompt in one step
    for side in (p["engine"], p["transformers"]):
        assert all(_positive(t) for t in side["times_s"]) and _positive(side["tokens_per_s"])
        assert side["tokens_per_s"] == pytest.approx(q.prefill_tokens / side["median_s"])
    assert p["ratio"] == pytest.approx(p["engine"]["tokens_per_s"] / p["transformers"]["tokens_per_s"])

    aims = doc["aims"]
    assert aims["aim_ratio_b1"] == 1.5 and aims["aim_ratio_b32"] == 2.0
    assert aims["aim_ratio_b1_measured"] == pytest.approx(doc["decode"][0]["ratio"])
    assert aims["aim_ratio_b1_met"] is (doc["decode"][0]["ratio"] >= 1.5)
    assert aims["aim_ratio_b32_measured"] is None and aims["aim_ratio_b32_met"] is None  # not run
    assert _positive(doc["wall_s"])


def test_bad_settings_name_the_field(tiny_llama_dir: str, capsys) -> None:
    assert bench.main(["--model", tiny_llama_dir, "--batch-sizes", "0,2", "--no-progress"]) == 2
    assert "batch_sizes" in capsys.readouterr().err
    with pytest.raises(bench.BenchConfigError, match="new_tokens"):
        bench.run_decode_bench(tiny_llama_dir, new_tokens=0, progress=False)


def test_left_pad_masks_the_padding() -> None:
    ids, mask = bench.left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_prompts_have_the_asked_lengths(tiny_llama_dir: str) -> None:
    prompts, source = bench.make_prompts(tiny_llama_dir, [16, 16, 64], vocab_size=49152)
    assert [len(p) for p in prompts] == [16, 16, 64]
    assert source in ("sharegpt", "random")
    assert all(0 <= t < 49152 for p in prompts for t in p)


def test_attention_baseline_times_the_reference_attention_in_the_same_run(
        tiny_llama_dir: str, capsys, monkeypatch) -> None:
    """--attention-baseline: every row also carries the engine with PDSERVE_PAGED_ATTN=torch,
    and the kernel's gain is the quotient of the two; the setting is put back afterwards."""
    monkeypatch.delenv("PDSERVE_PAGED_ATTN", raising=False)
    rc = bench.main(["--model", tiny_llama_dir, "--quick", "--json", "--no-progress",
                     "--threads", "1", "--attention-baseline"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert "PDSERVE_PAGED_ATTN" not in os.environ
    assert doc["settings"]["attention_baseline"] is True
    assert doc["machine"]["decode_attention"]["path"] in ("c", "torch")
    for r in doc["decode"]:
        ref = r["engine_torch_attention"]
        assert len(ref["decode_s"]) == bench.QUICK.repeats and all(_positive(t) for t in ref["decode_s"])
        assert ref["tokens_per_s"] == pytest.approx(
            r["batch_size"] * bench.QUICK.new_tokens / ref["median_s"])
        assert r["attention_kernel_gain"] == pytest.approx(ref["median_s"] / r["engine"]["median_s"])


def test_linear_baseline_times_a_onednn_engine_in_the_same_run(
        tiny_llama_dir: str, capsys, monkeypatch) -> None:
    """--linear-baseline (with --attention-baseline too): every row also carries a second engine
    whose linear layers run on oneDNN, while the first runs the path PDSERVE_LINEAR asks for (the
    C kernel where it builds); the gain is the quotient; the setting is put back afterwards."""
    from pdserve.engine import linear_cpu
    from pdserve.engine.linear import packing_available

    path = "c" if linear_cpu.available() else "reference"
    monkeypatch.setenv("PDSERVE_LINEAR", path)
    rc = bench.main(["--model", tiny_llama_dir, "--quick", "--json", "--no-progress",
                     "--threads", "1", "--linear-baseline", "--attention-baseline"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert os.environ["PDSERVE_LINEAR"] == path  # the baseline's own setting was put back
    assert doc["settings"]["linear_baseline"] is True
    # The two engines really multiply their weights two different ways.
    assert doc["machine"]["linear"] == ("c" if path == "c" else "plain")
    assert doc["machine"]["linear_baseline"] == (
        "onednn" if packing_available(torch.float32, torch.device("cpu")) else "plain")
    for r in doc["decode"]:
        for name, gain in (("engine_onednn_linear", "linear_kernel_gain"),
                           ("engine_torch_attention", "attention_kernel_gain")):
            ref = r[name]
            assert len(ref["decode_s"]) == bench.QUICK.repeats
            assert all(_positive(t) for t in ref["decode_s"])
            assert r[gain] == pytest.approx(ref["median_s"] / r["engine"]["median_s"])
