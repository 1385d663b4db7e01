"""Tokenizer, chat template, incremental detokenizer and stop strings, checked against transformers."""

from __future__ import annotations

import json

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.detokenizer import IncrementalDetokenizer, StopChecker
from pdserve.engine.prompts import DatasetError, iter_records, load_sharegpt_prompts
from pdserve.engine.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

TRICKY = [
    "", " ", "x", "Hello world", " leading space", "trailing space ",
    "😀 emoji 🤖🏳️‍🌈 family: 👨‍👩‍👧‍👦", "日本語のテキストと中文混合", "한국어 텍스트", "Ünïcödé çàfé naïve",
    "  runs   of\n\n\n\tspace \t \r\n  ", "\n", "1234567890 3.14159 -42 1e10", "don't I'll WE'LL they're",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|><jupyter_code>x",
    "text <|im_end|> more", "<|im_start", "def f(x):\n    return {'a': [1, 2]}\n", "a" * 300,
    "\u200b zero width \ufeff bom", "ab\ufffdcd", "mixed 😀日本 ok",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Tell me a joke 😀"}, {"role": "assistant", "content": "No."},
     {"role": "user", "content": "日本語で?"}],
]


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return load_sharegpt_prompts(200, seed=0, min_chars=16, max_chars=2000) + TRICKY


@pytest.fixture(scope="module")
def gguf_tok(smollm2_gguf_path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_gguf_path)


# ---- encode / decode ---------------------------------------------------------------------------


def test_gguf_encode_equals_transformers(gguf_tok, smollm2_hf_tokenizer, prompts):
    for text in prompts:
        assert gguf_tok.encode(text) == smollm2_hf_tokenizer.encode(text), text[:80]
        assert gguf_tok.encode(text, add_special_tokens=False) == \
            smollm2_hf_tokenizer.encode(text, add_special_tokens=False), text[:80]
    assert gguf_tok.encode_batch(prompts[:10]) == [gguf_tok.encode(p) for p in prompts[:10]]


def test_hf_folder_encode_equals_transformers(tiny_llama_dir, gguf_tok, prompts):
    from transformers import AutoTokenizer

    ours, ref = Tokenizer.from_path(tiny_llama_dir), AutoTokenizer.from_pretrained(tiny_llama_dir)
    for text in prompts:
        ids = ours.encode(text)
        assert ids == ref.encode(text) == gguf_tok.encode(text), text[:80]
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text[:80]
    assert ours.eos_token_ids == gguf_tok.eos_token_ids == (2,)
    assert ours.bos_token_id == gguf_tok.bos_token_id == 1
    assert ours.vocab_size == gguf_tok.vocab_size == 49152
    assert ours.name.startswith("tiny_llama")


def test_decode_round_trips_and_equals_transformers(gguf_tok, smollm2_hf_tokenizer, prompts):
    for text in prompts:
        ids = gguf_tok.encode(text)
        assert gguf_tok.decode(ids, skip_special_tokens=False) == text
        for skip in (True, False):
            assert gguf_tok.decode(ids, skip_special_tokens=skip) == \
                smollm2_hf_tokenizer.decode(ids, skip_special_tokens=skip), text[:80]
    ids = gguf_tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and gguf_tok.decode(ids) == "user\nhi"


def test_gguf_special_ids_and_name(gguf_tok):
    assert gguf_tok.eos_token_ids == (2,) and gguf_tok.bos_token_id == 1
    assert gguf_tok.vocab_size == 49152
    assert gguf_tok.name == "SmolLM2-135M-Instruct.Q4_1"
    assert gguf_tok.encode("Hello") == gguf_tok.encode("Hello", add_special_tokens=False)  # no BOS


def test_gguf_non_bpe_tokenizer_is_rejected(tmp_path):
    path = str(tmp_path / "spm.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(TokenizerError, match="'llama' is not supported"):
        Tokenizer.from_path(path)


# ---- chat template -----------------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(gguf_tok, smollm2_hf_tokenizer, tiny_llama_dir,
                                           add_generation_prompt):
    hf_folder_tok = Tokenizer.from_path(tiny_llama_dir)
    for messages in CONVERSATIONS:
        ref = smollm2_hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert gguf_tok.apply_chat_template(messages, add_generation_prompt) == ref
        assert hf_folder_tok.apply_chat_template(messages, add_generation_prompt) == ref


def test_chat_template_variables_and_raise_exception(gguf_tok):
    tok = Tokenizer(gguf_tok.backend, name="t", special_tokens={"bos_token": "<|im_start|>",
                    "eos_token": "<|im_end|>"}, eos_token_ids=(2,), chat_template=(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
        "{% generation %}{{ eos_token }}{% endgeneration %}"))
    assert tok.apply_chat_template([{"role": "user", "content": "<a&b>"}]) == \
        '<|im_start|>"<a&b>"<|im_end|>'
    with pytest.raises(ChatTemplateError, match="user first"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


# ---- incremental detokenization ----------------------------------------------------------------


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push([i]) for i in ids] + [detok.flush()]


def test_incremental_deltas_concatenate_to_decode(gguf_tok, prompts):
    for text in prompts:
        ids = gguf_tok.encode(text)
        for skip in (True, False):
            deltas = stream(IncrementalDetokenizer(gguf_tok, skip_special_tokens=skip), ids)
            assert "".join(deltas) == gguf_tok.decode(ids, skip_special_tokens=skip), text[:80]


def test_incremental_holds_back_split_characters(gguf_tok):
    text = "🤖🏳️‍🌈 日本語"
    ids = gguf_tok.encode(text)
    # The premise: some tokens carry only part of a character's UTF-8 bytes.
    assert any(gguf_tok.decode([i]).endswith("\ufffd") for i in ids)
    deltas = stream(IncrementalDetokenizer(gguf_tok), ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas[:-1]  # held back at least once


def test_incremental_with_prompt_context(gguf_tok, prompts):
    for prompt, completion in zip(prompts[:50], prompts[1:51]):
        p_ids, c_ids = gguf_tok.encode(prompt), gguf_tok.encode(completion)
        deltas = stream(IncrementalDetokenizer(gguf_tok, prompt_ids=p_ids), c_ids)
        full = gguf_tok.decode(p_ids + c_ids)
        assert "".join(deltas) == full[len(gguf_tok.decode(p_ids)):]


def test_incremental_decodes_o1_tokens_per_step(gguf_tok, prompts):
    class Spy:
        longest = 0

        def decode(self, ids, skip_special_tokens=True):
            Spy.longest = max(Spy.longest, len(ids))
            return gguf_tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = gguf_tok.encode(" ".join(prompts[:20]) + " 😀日本語 " * 20)
    assert len(ids) > 1000
    deltas = stream(IncrementalDetokenizer(Spy(), prompt_ids=ids[:100]), ids[100:])
    assert "".join(deltas) == gguf_tok.decode(ids)[len(gguf_tok.decode(ids[:100])):]
    assert Spy.longest <= 12


# ---- stop strings ------------------------------------------------------------------------------


def stream_with_stops(chunks: list[str], stops: list[str]) -> tuple[str, bool]:
    """What a client receives: text emitted chunk by chunk, as the router does it."""
    checker = StopChecker(stops)
    text, emitted, checked = "", "", 0
    for chunk in chunks:
        text += chunk
        result = checker.check(text, checked)
        checked = len(text)
        emitted += text[len(emitted):max(result.emit_until, len(emitted))]
        assert text.startswith(emitted)
        if result.stopped:
            return emitted, True
    return text, False  # end of generation: flush everything


def reference_truncate(text: str, stops: list[str]) -> str:
    """Cut at the stop string that completes first (as if streamed one character at a time)."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return text[:min(hits)[1]] if hits else text


def test_stop_string_spanning_tokens_is_never_partly_emitted(gguf_tok):
    text = "The quick brown fox jumps over the lazy dog. Then it sleeps."
    ids = gguf_tok.encode(text)
    detok = IncrementalDetokenizer(gguf_tok)
    chunks = [detok.push([i]) for i in ids]
    assert not any("fox jum" in c for c in chunks)  # the stop string spans tokens
    out, stopped = stream_with_stops(chunks, ["fox jum", "never"])
    assert stopped and out == "The quick brown "


def test_stop_checker_holdback():
    checker = StopChecker(["</s>", "STOP"])
    assert checker.max_holdback == 3
    assert checker.holdback("abc</") == 2 and checker.holdback("abcST") == 2
    assert checker.holdback("abc") == 0 and checker.holdback("<") == 1
    r = checker.check("hello </")
    assert not r.stopped and r.emit_until == len("hello ")
    r = checker.check("hello </s> more STOP")
    assert r.stopped and r.emit_until == len("hello ") and r.stop_string == "</s>"
    # The first to complete wins, whatever the chunking.
    r = StopChecker(["aab", "b"]).check("xaab")
    assert r.stop_string == "aab" and r.emit_until == 1  # tie on the end: the longer one
    r = StopChecker(["a a", " "]).check("aa a")
    assert r.stop_string == " " and r.emit_until == 2
    with pytest.raises(ValueError):
        StopChecker([""])


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab ", max_size=40),
       stops=st.lists(st.text(alphabet="ab ", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12))
def test_stop_streaming_equals_reference(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, _ = stream_with_stops(chunks, stops)
    assert out == reference_truncate(text, stops)


# ---- ShareGPT prompts --------------------------------------------------------------------------


def test_sharegpt_prompts_are_seeded_distinct_and_bounded(prompts):
    sample = prompts[:200]
    assert len(set(sample)) == 200 and all(16 <= len(p) <= 2000 for p in sample)
    assert load_sharegpt_prompts(200, seed=0, min_chars=16, max_chars=2000) == sample
    assert load_sharegpt_prompts(20, seed=1, min_chars=16, max_chars=2000) != sample[:20]
    with pytest.raises(DatasetError, match="asked for"):
        load_sharegpt_prompts(10**7)


def test_iter_records_stops_at_a_truncated_tail(tmp_path, monkeypatch):
    import pdserve.engine.prompts as prompts_mod

    records = [{"id": str(i), "conversations": [{"from": "human", "value": "q" * i}]} for i in range(30)]
    text = json.dumps(records, indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.rfind('"value"')])  # cut inside the last record
    monkeypatch.setattr(prompts_mod, "_CHUNK_CHARS", 7)  # records straddle chunk boundaries
    assert list(iter_records(str(path))) == records[:-1]
    path.write_text(text)
    assert list(iter_records(str(path))) == records
