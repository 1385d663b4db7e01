"""`pdserve bench quant --quick` on the tiny random Llama: the document's shape and arithmetic.

Neither accuracy nor speed is asserted here (the engine test checks int8 follows fp32 on the
real model; speed is the benchmark's to report): only that every figure is there, in range,
and that the derived ones are computed from the raw ones.
"""

from __future__ import annotations

import json

import torch

from pdserve.bench import quant as bench


def test_quick_json_document(tiny_llama_dir: str, tmp_path, capsys) -> None:
    out_dir = tmp_path / "out"
    threads = torch.get_num_threads()
    rc = bench.main(["--model", tiny_llama_dir, "--quick", "--json", "--out", str(out_dir),
                     "--no-progress", "--threads", "1"])
    assert rc == 0
    assert torch.get_num_threads() == threads
    doc = json.loads(capsys.readouterr().out)
    with open(out_dir / "quant.json", encoding="utf-8") as f:
        assert json.load(f) == doc
    assert (out_dir / "quant.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    q = bench.QUICK
    g, lp = doc["greedy"], doc["logprobs"]
    assert doc["bench"] == "quant" and doc["quantization"] == "int8"
    assert len(g["prefix_tokens"]) == q.prompts
    assert all(0 <= n <= q.new_tokens for n in g["prefix_tokens"])
    curve = g["all_agree_share_by_position"]
    assert len(curve) == q.new_tokens and curve == sorted(curve, reverse=True)
    for n, share in g["all_agree_share"].items():
        assert share == sum(p >= int(n) for p in g["prefix_tokens"]) / q.prompts
    assert lp["positions"] == q.prompts * q.new_tokens
    assert 0 <= lp["logprob_abs_diff_mean"] <= lp["logprob_abs_diff_max"]
    assert 0 <= lp["kl_mean"] <= lp["kl_max"]
    assert 0 <= lp["teacher_forced_top1_agreement"] <= 1
    wb = doc["model"]["weight_bytes"]
    assert wb["int8"] < wb["fp32"]
    assert [r["batch_size"] for r in doc["decode"]] == list(q.batch_sizes)
    for r in doc["decode"]:
        assert len(r["fp32"]["seconds"]) == len(r["int8"]["seconds"]) == q.repeats
        assert r["speedup"] == r["int8"]["tokens_per_s"] / r["fp32"]["tokens_per_s"]


def test_bad_settings_name_the_field(capsys) -> None:
    assert bench.main(["--model", "unused", "--agree-at", "100", "--new-tokens", "8"]) == 2
    assert "agree_at" in capsys.readouterr().err
