"""The trained drafters (EAGLE-, DFlash-, DSpark-style) and their self-distillation recipe, on a
tiny random Llama.

Random drafters check the mechanics (checkpoint round trip, batching with ragged windows,
valid outputs, refusing a checkpoint for another target); short training runs on a target with
repetitive greedy output check that training learns the target's next tokens.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from pdserve.engine.loader import load_checkpoint
from pdserve.engine.model import LlamaModel
from pdserve.engine.spec import DraftRequest, Drafter
from pdserve.engine.spec.draft_model import (KINDS, DraftNet, ModelDrafter, SharedTarget,
                                             draft_config_for, load_drafter, save_drafter)
from pdserve.engine.spec.train import is_held_out, train_draft


pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [f"Tell me about topic number {i}, and then {i * 7} more things." for i in range(8)]


@pytest.fixture(scope="module")
def target(repeaty_llama_dir: str) -> LlamaModel:
    cfg, w = load_checkpoint(repeaty_llama_dir, torch.float32)
    return LlamaModel(cfg, w)


def random_net(target: LlamaModel, kind: str, seed: int = 0) -> DraftNet:
    """An untrained drafter with large weights, so its proposals vary with the input."""
    g = torch.Generator().manual_seed(seed)
    d2t = torch.randperm(target.cfg.vocab_size, generator=g)[:300].sort().values
    net = DraftNet(draft_config_for(target, kind, window=8, gamma=4, draft_vocab_size=300,
                                    markov_rank=8), SharedTarget(target, d2t))
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return net.eval()


def requests(target: LlamaModel, seed: int = 1) -> list[DraftRequest]:
    g = torch.Generator().manual_seed(seed)
    d, v = target.cfg.hidden_size, target.cfg.vocab_size
    out = []
    for w, k in [(3, 4), (0, 4), (12, 6), (8, 1), (5, 0), (1, 3)]:
        toks = torch.randint(3, v, (w + 2,), generator=g).tolist()
        out.append(DraftRequest(toks, k, torch.randn(w, d, generator=g) * 2))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_batching_and_valid_drafts(kind, target, tmp_path):
    net = random_net(target, kind)
    drafter = ModelDrafter(net)
    assert isinstance(drafter, Drafter) and drafter.needs_hidden and drafter.window == 8
    reqs = requests(target)
    batched = drafter.propose(reqs)
    single = [drafter.propose([r])[0] for r in reqs]
    save_drafter(net, str(tmp_path / kind))
    loaded = load_drafter(str(tmp_path / kind), target, expect_kind=kind).propose(reqs)
    allowed = set(net.shared.d2t.tolist())
    for r, b, s, lo in zip(reqs, batched, single, loaded):
        assert b.tokens == s.tokens == lo.tokens
        if r.k == 0 or r.hidden.shape[0] == 0:
            assert b.tokens == []
            continue
        assert 1 <= len(b.tokens) <= min(r.k, 4 if kind != "eagle" else r.k)
        assert set(b.tokens) <= allowed and all(0 <= t < target.cfg.vocab_size for t in b.tokens)
        if kind == "dspark":
            assert len(b.confidence) == len(b.tokens)
            assert all(0.0 <= c <= 1.0 for c in b.confidence)
            assert torch.allclose(torch.tensor(b.confidence), torch.tensor(s.confidence),
                                  atol=1e-5)
            assert b.confidence == lo.confidence
        else:
            assert b.confidence is None
    # Proposals depend on the input: not one token for everything.
    assert len({t for b in batched for t in b.tokens}) > 1
    # A window longer than the drafter's reads only its last `window` rows.
    r = reqs[2]
    cut = DraftRequest(r.token_ids, r.k, r.hidden[-8:])
    assert drafter.propose([cut])[0].tokens == batched[2].tokens


def test_eagle_serial_drafts_extend_each_other(target):
    drafter = ModelDrafter(random_net(target, "eagle", seed=3))
    r = requests(target)[2]
    long = drafter.propose([r])[0].tokens
    assert len(long) == 6
    for k in (1, 3):
        assert drafter.propose([DraftRequest(r.token_ids, k, r.hidden)])[0].tokens == long[:k]


def test_load_refuses_a_checkpoint_for_something_else(target, tmp_path):
    path = str(tmp_path / "eagle")
    save_drafter(random_net(target, "eagle"), path)
    with pytest.raises(ValueError, match="kind"):
        load_drafter(path, target, expect_kind="dflash")
    cfg_file = os.path.join(path, "config.json")
    good = json.load(open(cfg_file))
    for change, what in [({"target_name": "other-model"}, "target"),
                         ({"hidden_size": 32}, "hidden_size"),
                         ({"format_version": 99}, "format_version")]:
        json.dump({**good, **change}, open(cfg_file, "w"))
        with pytest.raises(ValueError, match=what):
            load_drafter(path, target, expect_kind="eagle")
    with pytest.raises(ValueError):
        load_drafter(str(tmp_path / "missing"), target)


def test_held_out_split_is_fixed():
    picked = [is_held_out(f"prompt {i}") for i in range(400)]
    assert picked == [is_held_out(f"prompt {i}") for i in range(400)]
    assert 20 < sum(picked) < 90  # about one in eight


TINY = dict(max_new_tokens=16, window=8, draft_vocab_size=256, seed=0, batch_size=2, progress=False)


def test_eagle_training_learns_the_targets_greedy_tokens(repeaty_llama_dir, tmp_path, monkeypatch,
                                                         capsys):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))  # the data is built once
    # With its progress display on, as `pdserve train-draft` runs by default.
    untrained = train_draft(repeaty_llama_dir, "eagle", str(tmp_path / "e0"), epochs=0,
                            prompts=PROMPTS, eval_prompts=PROMPTS, **{**TINY, "progress": True})
    assert "target answers" in capsys.readouterr().out
    trained = train_draft(repeaty_llama_dir, "eagle", str(tmp_path / "e1"), epochs=12,
                          prompts=PROMPTS, eval_prompts=PROMPTS, **TINY)
    assert trained["final_loss"] < 0.6 * trained["first_loss"]
    assert trained["held_out_acceptance_length"] > untrained["held_out_acceptance_length"] + 0.5
    # The saved drafter is the one that was measured, and loads for the same target.
    cfg, w = load_checkpoint(repeaty_llama_dir, torch.float32)
    assert load_drafter(str(tmp_path / "e1"), LlamaModel(cfg, w), expect_kind="eagle").window == 8


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_block_drafter_training_lowers_the_loss(kind, repeaty_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    stats = train_draft(repeaty_llama_dir, kind, str(tmp_path / kind), epochs=6, prompts=PROMPTS[:4],
                        eval_prompts=PROMPTS[:2], **TINY)
    assert stats["final_loss"] < 0.8 * stats["first_loss"]
    assert stats["held_out_acceptance_length"] >= 1.0
    saved = json.load(open(os.path.join(tmp_path / kind, "config.json")))
    assert saved["kind"] == kind and saved["stats"]["train_sequences"] == 4
