"""`pdserve bench spec --quick` on a tiny random Llama: the document's shape, the acceptance
arithmetic, exactness against no speculation, the files, and skipping drafters not built yet.

Speed is never asserted here (the machines are shared); only that every figure is present and
consistent with the counts it is built from.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from pdserve.bench import spec as bench
from pdserve.engine.config import SpecConfig
from pdserve.engine.engine import LLMEngine

from tests.conftest import make_tiny_hf_model


@pytest.fixture(scope="module")
def repeaty_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # Tied embeddings and a larger init: greedy output repeats, so n-grams find drafts.
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny_llama_bench_spec"), "llama",
                              tie_word_embeddings=True, initializer_range=0.1)


def test_quick_none_ngram(repeaty_llama_dir: str, tmp_path, capsys) -> None:
    out_dir = tmp_path / "out"
    threads = torch.get_num_threads()
    # Without the confidence schedule: it cuts drafts by step costs timed on this machine, so
    # whether any draft survives depends on the host's load; here speculation must happen.
    rc = bench.main(["--model", repeaty_llama_dir, "--methods", "none,ngram", "--quick", "--json",
                     "--out", str(out_dir), "--no-progress", "--threads", "1", "--no-schedule"])
    assert rc == 0
    assert torch.get_num_threads() == threads
    doc = json.loads(capsys.readouterr().out)  # stdout is exactly one JSON document
    with open(out_dir / "results.json", encoding="utf-8") as f:
        assert json.load(f) == doc
    png = (out_dir / "speedup.png").read_bytes()
    assert len(png) > 1000 and png[:8] == b"\x89PNG\r\n\x1a\n"

    assert doc["bench"] == "spec" and doc["all_exact"] is True
    assert doc["skipped"] == {} and doc["errors"] == {}
    st = doc["settings"]
    assert st["methods"] == ["none", "ngram"] and st["batch_sizes"] == [1, 2]
    assert st["gamma"] == bench.QUICK["gamma"] and st["max_tokens"] == bench.QUICK["max_tokens"]
    assert all(0 < n <= st["max_prompt_tokens"] for n in st["prompt_tokens"])
    rows = {(r["method"], r["batch_size"]): r for r in doc["rows"]}
    assert set(rows) == {(m, b) for m in ("none", "ngram") for b in (1, 2)}
    for (m, b), r in rows.items():
        assert r["status"] == "ok" and r["exact"] is True and r["mismatched_prompts"] == []
        assert r["decode_tokens"] == b * (st["max_tokens"] - 1)  # ignore_eos: all run to the end
        assert r["tokens_per_s"] > 0 and r["speedup"] > 0
        assert r["tokens_per_step"] >= 1
        if m == "none":
            assert r["speedup"] == 1.0 and r["drafts"] == 0 and r["acceptance_length"] == 1.0
        elif r["drafts"]:
            assert r["acceptance_length"] >= 1
            assert r["acceptance_length"] == pytest.approx(
                (r["accepted_tokens"] + r["drafts"]) / r["drafts"])
            assert sum(r["accepted_per_pos"]) == r["accepted_tokens"] <= r["draft_tokens"]
            assert 1 <= r["mean_draft_len"] <= st["gamma"]
        else:
            assert r["acceptance_length"] is None
    assert any(rows[("ngram", b)]["drafts"] > 0 for b in (1, 2))  # speculation did happen


def test_missing_drafter_is_skipped(monkeypatch, repeaty_llama_dir: str, tmp_path) -> None:
    def missing(method: str, model_path: str, progress: bool = True) -> str:
        raise ImportError("No module named 'pdserve.engine.spec.train'")

    monkeypatch.setattr(bench, "draft_dir", missing)
    rc = bench.main(["--model", repeaty_llama_dir, "--methods", "eagle", "--quick",
                     "--no-progress", "--threads", "1", "--out", str(tmp_path)])
    assert rc == 0  # a drafter that is not built yet is reported, not a failure
    doc = json.loads((tmp_path / "results.json").read_text())
    assert "eagle" in doc["skipped"] and "spec.train" in doc["skipped"]["eagle"]
    assert [(r["method"], r["status"]) for r in doc["rows"]] == [
        ("none", "ok"), ("eagle", "skipped"), ("none", "ok"), ("eagle", "skipped")]


def test_mismatch_fails_the_run(monkeypatch, repeaty_llama_dir: str, tmp_path) -> None:
    real_step = LLMEngine.step

    def corrupt(self: LLMEngine):  # an n-gram engine whose output is off by one token id
        outs = real_step(self)
        if self.cfg.spec is not None:
            for o in outs:
                o.new_token_ids = [(t + 1) % 1000 for t in o.new_token_ids]
        return outs

    monkeypatch.setattr(LLMEngine, "step", corrupt)
    rc = bench.main(["--model", repeaty_llama_dir, "--methods", "ngram", "--quick",
                     "--no-progress", "--threads", "1", "--out", str(tmp_path)])
    assert rc == 1
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["all_exact"] is False
    assert any(r["method"] == "ngram" and not r["exact"] for r in doc["rows"])


def test_bad_settings_and_cli_registration() -> None:
    assert bench.main(["--methods", "none,medusa", "--quick", "--no-progress"]) == 2
    assert bench.main(["--batch-sizes", "0", "--no-progress"]) == 2
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="bench")
    bench.add_spec_bench_parser(sub)
    args = p.parse_args(["spec", "--methods", "none,ngram", "--no-schedule", "--gamma", "3"])
    assert args.func is bench.run_spec_bench
    assert args.methods == ("none", "ngram") and args.schedule is False and args.gamma == 3
    s = bench.SpecBenchSettings(methods=("ngram",))
    assert s.all_methods == ("none", "ngram")
    assert SpecConfig(method="ngram", schedule=False).schedule is False
