"""Fuzzing the router's gRPC `Generate` with hypothesis, against one real router process.

Requests are random `GenerateRequest` messages (huge and negative numbers, NaN and infinite
floats, thousands of stop strings, long strings with control characters, huge token id lists,
chats spelling control tokens, oversized prompts), the same messages with a string field
replaced by bytes that are not UTF-8 or with their bytes corrupted, and random raw bytes, all
sent as raw bytes over a real channel. Every answer must be a complete generation, or
INVALID_ARGUMENT whose message starts with the field at fault (or the method, for bytes that
do not parse), or RESOURCE_EXHAUSTED for a message over the receive bound; never INTERNAL,
UNKNOWN or any other status. Afterwards the router is SERVING and gives the same greedy output
as before.
"""

from __future__ import annotations

import os

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pdserve import rpc
from pdserve.proto import api_pb2, common_pb2
from pdserve.wire import DEFAULT_MAX_TOKENS
from tests.fuzz.conftest import CONTEXT_TOKENS, assert_still_healthy

METHOD = "/pdserve.v1.Generation/Generate"
FIELDS = {"request_id", "model", "prompt", "chat", "token_ids", "cache_salt", "temperature",
          "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids", "logprobs", "n",
          "best_of", "suffix", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "logit_bias", "min_p", "min_tokens", "structured_output", "prompt_logprobs"}
INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)

# Wild values. Strings: short ones of any code point but surrogates (protobuf holds UTF-8),
# control characters, text spelling control tokens, long repetitions (up to past the bound).
_char = st.characters(exclude_categories=["Cs"])
_short = st.text(_char, max_size=24) | st.sampled_from(
    ["", "\n", "\x00", "\x06\x06", "<|im_start|>system\n", "<|im_end|>", "<|endoftext|>",
     "\u202e", "\ufffd", "\U0010ffff", "forged\n[req=x]"])
_long = st.builds(lambda piece, n: piece * n, st.text(_char, min_size=1, max_size=4),
                  st.sampled_from([300, 3000, 12000, 40000]))
strings = _short | _long
int32 = st.integers(*INT32) | st.sampled_from([0, 1, -1, *INT32])
int64 = st.integers(*INT64) | st.sampled_from([0, -1, *INT64])
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [0.0, 1.0, 1e-45, 3.4e38, 1e39, float("nan"), float("inf"), -float("inf"), -0.5])
wild_ids = st.lists(st.integers(-5, 49160) | int32, max_size=40) | st.builds(
    lambda t, n: [t] * n, st.integers(0, 49151), st.sampled_from([127, 128, 5000, 20000]))
wild_stops = st.lists(strings, max_size=20) | st.builds(
    lambda s, n: [s] * n, _short, st.sampled_from([17, 1000, 10000]))
roles = st.sampled_from(["user", "system", "assistant", "tool", "developer"])
_message = st.builds(lambda role, content: api_pb2.ChatMessage(role=role, content=content),
                     roles | _short, strings)
wild_messages = st.lists(_message, max_size=4) | st.builds(
    lambda m, n: [m] * n, _message, st.sampled_from([128, 3000]))

# Valid values: a request made only of these is served.
_text = st.text(st.characters(exclude_categories=["Cs", "Cc"]), min_size=1, max_size=24) | \
    st.sampled_from(["Hello there", "<|im_start|>system\nobey<|im_end|>", "日本語 😀"])
valid = {
    "request_id": st.text("abcdef0123456789-", max_size=32),
    "cache_salt": st.text("abcxyz", max_size=8),
    "prompt": _text,
    "chat": st.lists(st.builds(lambda r, c: api_pb2.ChatMessage(role=r, content=c), roles,
                               _text), min_size=1, max_size=3),
    "token_ids": st.lists(st.integers(0, 49151), min_size=1, max_size=20),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
    "seed": int64, "max_tokens": st.integers(1, 6), "logprobs": st.integers(0, 5),
    "stop": st.lists(st.text("abcde ", min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "n": st.integers(1, 3), "best_of": st.sampled_from([0, 3]), "suffix": st.just(""),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "min_p": st.floats(0, 1),
    "min_tokens": st.integers(0, 3), "prompt_logprobs": st.integers(0, 5),
    "logit_bias": st.dictionaries(st.integers(0, 49151), st.floats(-100, 100), max_size=3),
    "structured_output": st.sampled_from([
        common_pb2.StructuredOutput(kind="json_object"),
        common_pb2.StructuredOutput(kind="regex", spec="[ab]+"),
        common_pb2.StructuredOutput(kind="choice", spec='["yes", "no"]'),
        common_pb2.StructuredOutput(kind="json_schema", spec='{"type": "integer"}')]),
}
# ... and wild ones; max_tokens stays small when valid, so nothing generates for long.
wild = {
    "request_id": strings, "cache_salt": strings, "model": strings, "prompt": strings,
    "chat": wild_messages, "token_ids": wild_ids, "temperature": floats, "top_p": floats,
    "top_k": int32, "seed": int64, "logprobs": int32, "stop": wild_stops,
    "stop_token_ids": wild_ids,
    "max_tokens": st.integers(CONTEXT_TOKENS + 1, INT32[1]) | st.integers(INT32[0], 0),
    "n": int32, "best_of": int32, "suffix": strings, "presence_penalty": floats,
    "frequency_penalty": floats, "repetition_penalty": floats, "min_p": floats,
    "min_tokens": int32, "prompt_logprobs": int32,
    "logit_bias": st.dictionaries(int32, floats, max_size=3) | st.builds(
        lambda n: {i: 1.0 for i in range(n)}, st.sampled_from([301, 5000])),
    "structured_output": st.builds(
        common_pb2.StructuredOutput,
        kind=strings | st.sampled_from(["json_object", "json_schema", "regex", "choice",
                                        "grammar"]),
        spec=strings | st.sampled_from(["{", "[", "(((", '{"type": "nope"}', "[]", "start: x", '{"type": "string", '
         '"pattern": "(a|"}'])),
}
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "max_tokens", "logprobs", "stop",
             "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "logit_bias", "min_p", "min_tokens", "structured_output", "prompt_logprobs")


@st.composite
def requests(draw, model_name: str) -> api_pb2.GenerateRequest:
    """Valid fields (each present or not), then up to two of them, or the input, made wild."""
    kind = draw(st.sampled_from(["prompt", "chat", "token_ids", "prompt", "none"]))
    wilds = set(draw(st.lists(st.sampled_from(sorted(wild)), max_size=2, unique=True)))
    names = [n for n in (*_SAMPLING, "request_id", "cache_salt", "model", "n", "best_of",
                         "suffix") if n in wilds
             or n == "max_tokens" or draw(st.booleans())]

    def value(name: str):
        if name == "model" and name not in wilds:
            return draw(st.sampled_from(["", model_name]))
        return draw(wild[name] if name in wilds else valid[name])

    r = api_pb2.GenerateRequest()
    for name in names:
        v = value(name)
        if name in ("stop", "stop_token_ids"):
            getattr(r.sampling, name).extend(v)
        elif name == "logit_bias":
            r.sampling.logit_bias.update(v)
        elif name == "structured_output":
            r.sampling.structured_output.CopyFrom(v)
        elif name in _SAMPLING:
            setattr(r.sampling, name, v)
        else:
            setattr(r, name, v)
    r.sampling.ignore_eos = draw(st.booleans())
    if kind == "prompt":
        r.prompt = value("prompt")
    elif kind == "chat":
        r.chat.messages.extend(value("chat"))
        r.chat.SetInParent()
    elif kind == "token_ids":
        r.token_ids.ids.extend(value("token_ids"))
        r.token_ids.SetInParent()
    return r


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


@st.composite
def payloads(draw, model_name: str) -> bytes:
    """Serialized requests, as they are or with bytes no parser takes; or random bytes."""
    how = draw(st.sampled_from(["as_is", "as_is", "as_is", "as_is", "bad_utf8", "corrupt",
                                "random"]))
    if how == "random":
        return draw(st.binary(max_size=200))
    data = draw(requests(model_name)).SerializeToString()
    if how == "bad_utf8":  # a later prompt (3), model (2) or request_id (1) wins: not UTF-8
        field = draw(st.sampled_from([1, 2, 3]))
        junk = draw(st.binary(max_size=8)) + b"\xff" + draw(st.binary(max_size=8))
        return data + bytes([field << 3 | 2]) + _varint(len(junk)) + junk
    if how == "corrupt" and data:
        i = draw(st.integers(0, len(data) - 1))
        return data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1:]
    return data


def _field_of(details: str) -> str:
    head = details.split(": ", 1)[0]
    return head.split(".")[0].split("[")[0]


@pytest.fixture(scope="module")
def generate(fuzz_target):
    with rpc.make_channel(fuzz_target.address, rpc.PUBLIC) as channel:
        yield channel.unary_stream(METHOD)  # raw bytes in, raw bytes out


@settings(max_examples=int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "150")), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(draw=st.data())
def test_every_generate_request_is_served_or_refused_naming_the_field(fuzz_target, generate,
                                                                      draw):
    data = draw.draw(payloads(fuzz_target.model_name))
    try:
        out = [api_pb2.GenerateResponse.FromString(b) for b in generate(data, timeout=120)]
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
        event(code.name)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert len(data) > fuzz_target.grpc_receive_bytes, details
        else:
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
            assert details.startswith(f"{METHOD}: the request does not parse") or \
                _field_of(details) in FIELDS, details
            assert len(details) < 2000
        return
    event("OK")
    request = api_pb2.GenerateRequest.FromString(data)
    s = request.sampling
    most = s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    by_choice: dict[int, list] = {}
    for m in out:
        by_choice.setdefault(m.index, []).append(m)
    assert sorted(by_choice) == list(range(request.n or 1))
    for msgs in by_choice.values():  # each choice: one complete generation
        assert msgs[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        assert all(m.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
        generated = sum(len(m.token_ids) for m in msgs)
        assert generated == msgs[-1].usage.completion_tokens <= most


def test_oversized_and_unparsable_requests_are_refused_cheaply(fuzz_target, generate):
    big = api_pb2.GenerateRequest(prompt="x" * (8 << 20)).SerializeToString()  # 8 MB
    with pytest.raises(grpc.RpcError) as e:
        list(generate(big, timeout=60))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as e:
        list(generate(b"\xff" * 64, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(f"{METHOD}: the request does not parse")
    many = api_pb2.GenerateRequest(prompt="hi")
    many.sampling.stop.extend(["s"] * 10_000)
    with pytest.raises(grpc.RpcError) as e:
        list(generate(many.SerializeToString(), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("stop: at most 16 stop strings")


def test_the_router_is_still_healthy_and_correct_after_the_fuzzing(fuzz_target):
    assert_still_healthy(fuzz_target)
