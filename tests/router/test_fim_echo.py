"""Completions' `suffix` (fill in the middle) and `echo`.

A tokenizer with fill-in-the-middle tokens renders prefix, suffix and middle in the order code
models learn; one without (the default model's) answers a 400 naming `suffix`; `echo` returns
the prompt's text before the completion, streamed and whole, and refuses logprobs by name.
"""

from __future__ import annotations

import json
import os

import pytest

from pdserve.core.errors import InvalidArgumentError
from pdserve.engine.loader import default_model_path
from pdserve.engine.tokenizer import Tokenizer
from pdserve.proto import api_pb2, common_pb2
from pdserve.router.openai_format import Renderer
from pdserve.router.openai_schema import OpenAIError, parse_chat, parse_completion
from pdserve.router.validate import fill_in_the_middle, prompt_ids_of
from tests.conftest import _smollm2_tokenizer_files

FIM = {14: "<fim_prefix>", 15: "<fim_suffix>", 16: "<fim_middle>"}


@pytest.fixture(scope="module")
def fim_tokenizer(tmp_path_factory) -> Tokenizer:
    """SmolLM2's tokenizer with three of its unused control tokens renamed to the
    fill-in-the-middle ones (as a code model's tokenizer has them)."""
    path = tmp_path_factory.mktemp("fim_tokenizer")
    for name, data in _smollm2_tokenizer_files().items():
        if name == "tokenizer.json":
            tj = json.loads(data)
            for t in tj["added_tokens"]:
                if t["id"] in FIM:
                    old = t["content"]
                    t["content"] = FIM[t["id"]]
                    tj["model"]["vocab"][FIM[t["id"]]] = tj["model"]["vocab"].pop(old)
            data = json.dumps(tj).encode()
        (path / name).write_bytes(data)
    return Tokenizer.from_path(os.fspath(path))


def test_fill_in_the_middle_renders_prefix_suffix_middle(fim_tokenizer):
    ids = fill_in_the_middle(fim_tokenizer, "def add(a, b):\n    ", "\n\nprint(add(1, 2))")
    pre = fim_tokenizer.encode("def add(a, b):\n    ", add_special_tokens=False)
    suf = fim_tokenizer.encode("\n\nprint(add(1, 2))", add_special_tokens=False)
    assert ids == [14, *pre, 15, *suf, 16]
    # Through the router's prompt rules: the same ids.
    req = api_pb2.GenerateRequest(prompt="def add(a, b):\n    ", suffix="\n\nprint(add(1, 2))")
    assert prompt_ids_of(req, fim_tokenizer, 49152, 2048) == ids


def test_a_model_without_fim_tokens_refuses_suffix_by_name():
    tok = Tokenizer.from_path(default_model_path())
    with pytest.raises(InvalidArgumentError) as err:
        prompt_ids_of(api_pb2.GenerateRequest(prompt="x", suffix="y"), tok, 49152, 2048)
    assert err.value.field == "suffix" and "fill-in-the-middle" in err.value.message
    with pytest.raises(InvalidArgumentError) as err:
        req = api_pb2.GenerateRequest(suffix="y")
        req.token_ids.ids.extend([1, 2])
        prompt_ids_of(req, tok, 49152, 2048)
    assert err.value.field == "suffix"


@pytest.mark.parametrize("parse,body,param", [
    (parse_completion, {"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
    (parse_completion, {"prompt": [1, 2], "suffix": "y"}, "suffix"),
    (parse_completion, {"prompt": "x", "echo": "yes"}, "echo"),
    (parse_chat, {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    (parse_chat, {"messages": [{"role": "user", "content": "x"}], "suffix": "y"}, "suffix"),
])
def test_bad_echo_and_suffix_are_named(parse, body, param):
    with pytest.raises(OpenAIError) as err:
        parse(body)
    assert err.value.status == 400 and err.value.param == param


def test_echo_puts_the_prompt_before_every_choice():
    req = parse_completion({"prompt": "The sea", "echo": True, "n": 2, "stream": True})
    r = Renderer(req, "cmpl-1", "m", 0, str, echo="The sea")
    first = r.first_chunks()
    assert [c["choices"][0]["text"] for c in first] == ["The sea", "The sea"]
    assert [c["choices"][0]["index"] for c in first] == [0, 1]
    msgs = [api_pb2.GenerateResponse(text=" is", index=i) for i in (0, 1)] + [
        api_pb2.GenerateResponse(text=" blue", index=i, finish_reason=2,
                                 usage=api_pb2.Usage(prompt_tokens=2, completion_tokens=2))
        for i in (1, 0)]
    whole = Renderer(req, "cmpl-1", "m", 0, str, echo="The sea").full(msgs)
    assert [c["text"] for c in whole["choices"]] == ["The sea is blue"] * 2
    assert whole["usage"]["completion_tokens"] == 4 and whole["usage"]["prompt_tokens"] == 2


def test_echo_with_logprobs_puts_the_prompts_logprobs_first_for_every_choice():
    req = parse_completion({"prompt": "ab", "echo": True, "logprobs": 1, "n": 2,
                            "stream": True})
    assert req.prompt_logprobs == 1
    text = {1: "a", 2: "b", 3: "c", 4: "d"}.get
    prompt = dict(prompt_token_ids=[1, 2], prompt_logprobs=[common_pb2.TokenLogprobs(
        token_id=2, logprob=-0.5, top=[common_pb2.Logprob(token_id=3, logprob=-0.25)])])
    msgs = [api_pb2.GenerateResponse(index=i, text="c", token_ids=[3], **prompt, logprobs=[
        common_pb2.TokenLogprobs(token_id=3, logprob=-0.125)]) for i in (0, 1)] + [
        api_pb2.GenerateResponse(index=i, text="d", token_ids=[4], finish_reason=2, logprobs=[
            common_pb2.TokenLogprobs(token_id=4, logprob=-0.375)],
            usage=api_pb2.Usage(prompt_tokens=2, completion_tokens=2)) for i in (1, 0)]
    stream = Renderer(req, "cmpl-1", "m", 0, text, echo="ab")
    assert stream.first_chunks() == []  # the echo waits for the prompt's logprobs
    chunks = [c["choices"][0] for m in msgs for c in stream.chunks(m)]
    for i in (0, 1):
        mine = [c for c in chunks if c["index"] == i and c["logprobs"]]
        assert mine[0]["text"] == "ab" and mine[0]["logprobs"] == {
            "tokens": ["a", "b"], "token_logprobs": [None, -0.5],
            "top_logprobs": [None, {"c": -0.25, "b": -0.5}], "text_offset": [0, 1]}
        assert [c["logprobs"]["text_offset"] for c in mine[1:]] == [[2], [3]]
    whole = Renderer(req, "cmpl-1", "m", 0, text, echo="ab").full(msgs)
    for choice in whole["choices"]:
        assert choice["text"] == "abcd"
        assert choice["logprobs"]["tokens"] == ["a", "b", "c", "d"]
        assert choice["logprobs"]["token_logprobs"] == [None, -0.5, -0.125, -0.375]
        assert choice["logprobs"]["text_offset"] == [0, 1, 2, 3]
