"""Fuzzing the router's OpenAI HTTP API with hypothesis, against one real router process.

Bodies for `/v1/completions` and `/v1/chat/completions`: mostly valid requests with a few
fields made doubtful (wrong types, huge numbers, NaN), and raw bodies no JSON parser takes or
that hold what JSON forbids (invalid UTF-8, truncation, NaN and Infinity literals, 1e400, deep
nesting, huge bodies, a top level that is not an object). Every answer must be a 200 (a stream
too: no error event, ending with `[DONE]`) or a 4xx in OpenAI's shape: a 400 whose `param`
names a request field and whose message starts with it (or, with no field, a body that is not
a JSON object), 404 only for an unknown model, 413 only for a body over the bound; never a 5xx.
Afterwards the router is SERVING and gives the same greedy output as before.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.fuzz.conftest import MAX_BODY_BYTES, assert_still_healthy
from tests.router.test_openai_schema import FIELDS, bodies, root

PATHS = ("/v1/completions", "/v1/chat/completions")


def _nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


RAW = st.sampled_from([
    b"", b"{", b'{"prompt": "a"', b"\xff\xfe\x00", b'{"prompt": "\xff\xfe"}',
    b'{"prompt": "hi", "max_tokens": NaN}', b'{"prompt": "hi", "temperature": Infinity}',
    b'{"prompt": "hi", "temperature": -Infinity}', b'{"prompt": "hi", "top_p": 1e400}',
    b'{"prompt": "hi", "max_tokens": 1e400}', b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}",
    b'{"prompt": "hi", "max_tokens": ' + b"9" * 400 + b"}", b"[]", b"null", b"1", b'"x"',
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}', _nested(100), _nested(50_000),
    b'{"prompt": "' + b"x" * (MAX_BODY_BYTES + 1) + b'"}',
    b'{"messages": {"role": "user"}}', b'{"prompt": {"a": 1}}', b'{"prompt": [[1, 2], [3]]}',
    b'{"prompt": "hi", "stop": ' + json.dumps(["s"] * 10_000).encode() + b"}",
    b'{"prompt": "hi", "stop": ["' + b"s" * 300 + b'"]}',
    b'{"prompt": [' + b"5," * 20_000 + b"5]}", b'{"prompt": "' + b"ab" * 20_000 + b'"}',
    b'{"messages": [' + b'{"role": "user", "content": ""},' * 1000 + b"{}]}",
]) | st.binary(max_size=64)


@st.composite
def requests(draw, model: str) -> tuple[str, bytes, dict | None]:
    """(path, body bytes, the body as a dict when it is JSON of one)."""
    chat = draw(st.booleans())
    path = PATHS[chat]
    if draw(st.integers(0, 3)) == 0:
        return path, draw(RAW), None
    body = draw(bodies(chat, model))
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = draw(st.integers(1, 4))  # chat's default would be the context
    # json.dumps writes NaN and Infinity: Python's reader takes them, as clients send them.
    return path, json.dumps(body).encode(), body


def _sse_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


@pytest.fixture(scope="module")
def client(fuzz_target):
    with httpx.Client(base_url=fuzz_target.http_base, timeout=120) as c:
        yield c


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(draw=st.data())
def test_every_body_gets_a_2xx_or_a_4xx_naming_the_field(fuzz_target, client, draw):
    path, raw, body = draw.draw(requests(fuzz_target.model_name))
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    event(f"HTTP {r.status_code}")
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code == 200:
        if body is not None and body.get("stream") is True:
            events = _sse_events(r.text)
            assert events and events[-1] == "[DONE]", r.text[-300:]
            assert not any('"error"' in e and e.startswith('{"error"') for e in events), r.text
        else:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        return
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if r.status_code == 413:
        assert len(raw) > MAX_BODY_BYTES, err
    elif r.status_code == 404:
        assert err["code"] == "model_not_found", err
    else:
        assert r.status_code == 400, (r.status_code, err)
        if err["param"] is None:  # not a field's fault: the body itself is not an object
            assert err["code"] in ("invalid_json", "invalid_type"), err
            assert body is None or not isinstance(body, dict) or "body" in err["message"], err
        else:
            assert root(err["param"]) in FIELDS, err
            assert err["message"].startswith(err["param"]), err
        assert len(err["message"]) < 6000


def test_the_router_is_still_healthy_and_correct_after_the_fuzzing(fuzz_target):
    assert_still_healthy(fuzz_target)
