"""Size bounds on one request (`router.limits`, `validate.check_sizes`): pure, no processes.

A request too large to ever fit is refused naming the field before the tokenizer is called;
the bytes-per-token ceiling is a true ceiling on the default model's tokenizer; the HTTP API
holds stop strings, stop token ids and the cache salt to the same bounds as gRPC; an HTTP body
that passes its bound becomes a gRPC message that passes the router's receive bound; the stop
check's holdback equals its brute-force definition.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.detokenizer import StopChecker
from pdserve.engine.sampling import InvalidArgumentError
from pdserve.engine.tokenizer import Tokenizer
from pdserve.proto import api_pb2
from pdserve.router import limits
from pdserve.router.openai_api import OpenAIApp
from pdserve.router.openai_schema import (OpenAIError, error_from_status, parse_chat,
                                          parse_completion)
from pdserve.router.validate import check_model, check_sizes, prompt_ids_of
from tests.router.test_openai_schema import bodies

MAX_LEN = 128


@pytest.fixture(scope="module")
def tok(smollm2_gguf_path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_gguf_path)


class _Spy:
    """The real tokenizer, counting how often a prompt is encoded."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.max_token_bytes = tok.max_token_bytes
        self.calls = 0

    def encode(self, *a, **k):
        self.calls += 1
        return self.tok.encode(*a, **k)

    def encode_chat(self, *a, **k):
        self.calls += 1
        return self.tok.encode_chat(*a, **k)


def _refused(request, tok, max_len: int = MAX_LEN) -> InvalidArgumentError:
    spy = _Spy(tok)
    with pytest.raises(InvalidArgumentError) as e:
        prompt_ids_of(request, spy, tok.vocab_size, max_len)
    assert spy.calls == 0, "refused only after tokenizing"
    assert str(e.value).startswith(e.value.field + ": ")
    return e.value


def _chat(*contents: str) -> api_pb2.GenerateRequest:
    r = api_pb2.GenerateRequest()
    r.chat.messages.extend(api_pb2.ChatMessage(role="user", content=c) for c in contents)
    return r


def test_prompts_too_long_to_ever_fit_are_refused_before_tokenizing(tok):
    most = limits.max_prompt_bytes(MAX_LEN, tok.max_token_bytes)
    assert most == (MAX_LEN - 1) * tok.max_token_bytes
    assert _refused(api_pb2.GenerateRequest(prompt="x" * (most + 1)), tok).field == "prompt"
    assert "bytes per token" in str(_refused(api_pb2.GenerateRequest(prompt="é" * most), tok))
    assert _refused(_chat("a" * most, "b"), tok).field == "chat.messages"  # the sum counts
    assert _refused(_chat(*[""] * MAX_LEN), tok).field == "chat.messages"
    ids = api_pb2.GenerateRequest()
    ids.token_ids.ids.extend([5] * MAX_LEN)
    assert _refused(ids, tok).field == "prompt"  # as when found too long after tokenizing
    # At the bound the tokenizer decides (here: too many tokens, found after tokenizing).
    spy = _Spy(tok)
    assert len(prompt_ids_of(api_pb2.GenerateRequest(prompt="x" * most), spy, 49152,
                             MAX_LEN)) >= MAX_LEN and spy.calls == 1


@pytest.mark.parametrize("change, field", [
    (lambda r: r.sampling.stop.extend(["s"] * (limits.MAX_STOP_STRINGS + 1)), "stop"),
    (lambda r: r.sampling.stop.extend(["ok", "é" * 129]), "stop[1]"),
    (lambda r: r.sampling.stop_token_ids.extend([1] * (limits.MAX_STOP_TOKEN_IDS + 1)),
     "stop_token_ids"),
    (lambda r: setattr(r, "request_id", "r" * (limits.MAX_REQUEST_ID_CHARS + 1)), "request_id"),
    (lambda r: setattr(r, "request_id", "forged\n[req=other] log line"), "request_id"),
    (lambda r: setattr(r, "cache_salt", "é" * 129), "cache_salt"),
])
def test_list_and_string_bounds_name_the_field(tok, change, field):
    r = api_pb2.GenerateRequest(prompt="hi")
    change(r)
    err = _refused(r, tok)
    assert err.field == field and len(str(err)) < 300


def test_requests_at_the_bounds_pass(tok):
    r = api_pb2.GenerateRequest(prompt="hi", request_id="r" * limits.MAX_REQUEST_ID_CHARS,
                                cache_salt="s" * limits.MAX_CACHE_SALT_BYTES)
    r.sampling.stop.extend(["é" * 128] * limits.MAX_STOP_STRINGS)
    r.sampling.stop_token_ids.extend([1] * limits.MAX_STOP_TOKEN_IDS)
    check_sizes(r, MAX_LEN, tok.max_token_bytes)


def test_values_quoted_in_errors_are_cut():
    with pytest.raises(InvalidArgumentError) as e:
        check_model("m" * 100_000, ("served",))
    assert e.value.field == "model" and len(str(e.value)) < 300


# SmolLM2's vocabulary has no token for these control bytes: the tokenizer (as transformers')
# drops them, so they are the one way a text can spell fewer tokens than its bytes suggest.
UNSPELLABLE = "\x04\x06\x13\x14\x16\x1d"


def test_unspellable_bytes_are_dropped_as_transformers_does(tok, smollm2_hf_tokenizer):
    for c in UNSPELLABLE:
        ids = tok.encode(f"a{c}b", add_special_tokens=False)
        assert ids == smollm2_hf_tokenizer.encode(f"a{c}b", add_special_tokens=False)
        assert tok.decode(ids) == "ab" and tok.encode(c * 1000, add_special_tokens=False) == []


SPELLABLE = st.characters(exclude_categories=["Cs"], exclude_characters=UNSPELLABLE)
LONG_RUNS = st.sampled_from(["#" * 4000, "-" * 3000, "\n" + " " * 5000, "x" * 4000, "=" * 999])


@settings(max_examples=200, deadline=None)
@given(text=st.text(SPELLABLE, min_size=1, max_size=400) | LONG_RUNS)
def test_the_bytes_per_token_ceiling_is_a_ceiling(tok, text):
    # No text of B bytes encodes to fewer than B / max_token_bytes tokens.
    n = len(tok.encode(text, add_special_tokens=False))
    assert n * tok.max_token_bytes >= len(text.encode("utf-8"))


def test_http_bodies_are_held_to_the_grpc_bounds():
    user = [{"role": "user", "content": "hi"}]
    for body, param in [
        ({"messages": user, "stop": ["a", "é" * 129]}, "stop[1]"),
        ({"messages": user, "stop": "é" * 129}, "stop"),
        ({"prompt": "x", "stop_token_ids": [1] * (limits.MAX_STOP_TOKEN_IDS + 1)},
         "stop_token_ids"),
        ({"prompt": "x", "cache_salt": "s" * (limits.MAX_CACHE_SALT_BYTES + 1)}, "cache_salt"),
    ]:
        with pytest.raises(OpenAIError) as e:
            (parse_chat if "messages" in body else parse_completion)(body)
        assert (e.value.status, e.value.param) == (400, param)
    chat = parse_chat({"messages": user, "stop": ["a", "b"]})
    assert error_from_status("INVALID_ARGUMENT", "stop[1]: too long", chat).param == "stop[1]"
    assert error_from_status("INVALID_ARGUMENT", "cache_salt: too long", chat).param == \
        "cache_salt"


@pytest.fixture(scope="module")
def app(tok) -> OpenAIApp:
    return OpenAIApp("127.0.0.1:1", ("m",), 512, tok, tok.vocab_size)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), chat=st.booleans())
def test_an_http_body_becomes_a_grpc_message_within_the_receive_bound(app, data, chat):
    body = data.draw(bodies(chat))
    # The shortest JSON for the body: the HTTP bound counts what the client sent.
    raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")
    try:
        req = (parse_chat if chat else parse_completion)(body)
        message = app._generate_request(req, "chatcmpl-" + "0" * 32)
    except OpenAIError:
        return
    assert message.ByteSize() <= limits.grpc_receive_bytes(len(raw))


def _holdback(stops: tuple[str, ...], text: str) -> int:
    """The definition: the longest suffix of text that is a proper prefix of a stop string."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


@settings(max_examples=500, deadline=None)
@given(stops=st.lists(st.text("abé", min_size=1, max_size=6), min_size=1, max_size=4),
       text=st.text("abé", max_size=12))
def test_the_holdback_is_its_definition(stops, text):
    checker = StopChecker(stops)
    assert checker.holdback(text) == _holdback(checker.stop_strings, text)
    r = checker.check(text)
    if not r.stopped:
        assert r.emit_until == len(text) - _holdback(checker.stop_strings, text)


def test_ids_of_a_normal_chat_are_its_rendered_texts(tok):
    r = _chat("What is 2+2?")
    assert prompt_ids_of(r, tok, tok.vocab_size, MAX_LEN) == tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}]),
        add_special_tokens=False)
    assert math.isfinite(tok.max_token_bytes) and tok.max_token_bytes >= 12  # <|im_start|>
