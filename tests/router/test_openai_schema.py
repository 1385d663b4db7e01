"""OpenAI request validation: unit tests, a property over random bodies, and the HTTP server's
error answers (a router process with HTTP and no reachable worker, so nothing generates).

Invariant 7: bad input gets a 400 in OpenAI's shape naming the field, never a 500, and the server
keeps serving.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pdserve.engine.loader import default_model_path
from pdserve.proto import common_pb2
from pdserve.router.openai_format import MIN_LOGPROB, Renderer
from pdserve.router.openai_schema import (DEFAULT_TEMPERATURE, OpenAIError, error_from_status,
                                          parse_chat, parse_completion, with_defaults)
from tests.helpers import free_port, process_output, start_process, stop_process

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
FIELDS = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "seed", "n", "stop", "stop_token_ids", "stream", "stream_options",
          "logprobs", "top_logprobs", "ignore_eos", "user", "presence_penalty",
          "frequency_penalty", "logit_bias", "echo", "suffix", "best_of", "response_format",
          "tools", "cache_salt", "repetition_penalty", "min_p", "min_tokens", "guided_json",
          "guided_regex", "guided_choice", "guided_grammar", "tool_choice", "parallel_tool_calls"}


def root(param: str) -> str:
    return param.split(".")[0].split("[")[0]


# ---- unit -----------------------------------------------------------------------------------

def test_chat_fields_map_to_the_generate_request():
    r = parse_chat({"messages": [{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}],
                    "max_completion_tokens": 7, "max_tokens": 3, "temperature": 0, "seed": -5,
                    "stop": "x", "logprobs": True, "top_logprobs": 4, "stream": True,
                    "stream_options": {"include_usage": True}, "n": 1, "top_k": -1})
    assert [(m.role, m.content) for m in r.messages] == [("system", "be brief"), ("user", "ab")]
    assert (r.max_tokens, r.temperature, r.seed, r.stop, r.logprobs) == (7, 0.0, -5, ("x",), 4)
    assert r.stream and r.include_usage and r.top_k == 0
    assert r.params["max_tokens"] == "max_completion_tokens"  # errors name what the client sent


def test_sampling_left_unset_takes_the_models_defaults_else_openais():
    model = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    r = with_defaults(parse_chat({"messages": USER}), model)
    assert (r.temperature, r.top_p, r.top_k) == (0.6, 0.95, 20)
    r = with_defaults(parse_chat({"messages": USER, "temperature": 0, "top_p": 1, "top_k": -1}),
                      model)
    assert (r.temperature, r.top_p, r.top_k) == (0.0, 1.0, 0)  # what the request sent wins
    r = with_defaults(parse_completion({"prompt": "hi", "top_p": 0.5}), {})
    assert (r.temperature, r.top_p, r.top_k) == (DEFAULT_TEMPERATURE, 0.5, 0)


def test_completion_prompt_forms_and_logprobs():
    assert parse_completion({"prompt": "hi"}).prompt == "hi"
    assert parse_completion({"prompt": ["hi"]}).prompt == "hi"
    assert parse_completion({"prompt": [1, 2, 3], "logprobs": 0}).prompt_ids == (1, 2, 3)
    assert parse_completion({"prompt": [[4, 5]]}).prompt_ids == (4, 5)
    assert parse_chat({"messages": USER, "logprobs": True}).logprobs == 0
    assert parse_chat({"messages": USER, "logprobs": False, "top_logprobs": None}).logprobs is None


@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "n": 17}, "n"),
    ({"messages": USER, "n": 3, "best_of": 2}, "best_of"),
    ({"messages": USER, "n": 1, "best_of": 2, "stream": True}, "best_of"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "max_completion_tokens": "5"}, "max_completion_tokens"),
    ({"messages": USER, "temperature": 2.5}, "temperature"),
    ({"messages": USER, "temperature": True}, "temperature"),
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": USER, "seed": 2**64}, "seed"),
    ({"messages": USER, "stop": ["a", 3]}, "stop"),
    ({"messages": USER, "stop": [""]}, "stop"),
    ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": USER, "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
    ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": USER, "presence_penalty": 2.5}, "presence_penalty"),
    ({"messages": USER, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": USER, "min_p": "0.1"}, "min_p"),
    ({"messages": USER, "min_tokens": -1}, "min_tokens"),
    ({"messages": USER, "logit_bias": {"12": 101}}, "logit_bias.12"),
    ({"messages": USER, "logit_bias": {"x": 1}}, "logit_bias"),
    ({"messages": USER, "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": USER, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "object", "properties": {
            "a": {"type": "integer"}}}}}}, "response_format.json_schema.schema"),
    ({"messages": USER, "guided_choice": []}, "guided_choice"),
    ({"messages": USER, "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"messages": USER, "guided_grammar": "\ud800"}, "guided_grammar"),
    ({"messages": USER, "guided_regex": "a\udfff"}, "guided_regex"),
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ({"messages": USER, "model": 7}, "model"),
])
def test_bad_chat_fields_are_named(body, param):
    with pytest.raises(OpenAIError) as err:
        parse_chat(body)
    assert err.value.status == 400 and err.value.param == param
    assert err.value.body()["error"]["message"].startswith(param)


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [-1]}, "prompt"),
    ({"prompt": None}, "prompt"), ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"), ({"prompt": "x", "echo": 1}, "echo"),
    ({"prompt": "x", "best_of": 0}, "best_of"), ({"prompt": "x", "stop_token_ids": [-1]},
                                                 "stop_token_ids"),
])
def test_bad_completion_fields_are_named(body, param):
    with pytest.raises(OpenAIError) as err:
        parse_completion(body)
    assert err.value.status == 400 and err.value.param == param


def test_grpc_errors_map_to_statuses_and_request_fields():
    chat = parse_chat({"messages": USER, "max_completion_tokens": 5, "logprobs": True,
                       "top_logprobs": 2})
    e = error_from_status("INVALID_ARGUMENT", "prefill: max_tokens: too many", chat)
    assert (e.status, e.param) == (400, "max_completion_tokens")
    assert error_from_status("INVALID_ARGUMENT", "chat.messages[1].role: no", chat).param == \
        "messages[1].role"
    assert error_from_status("INVALID_ARGUMENT", "prompt: too long", chat).param == "messages"
    assert error_from_status("INVALID_ARGUMENT", "logprobs: no", chat).param == "top_logprobs"
    e = error_from_status("INVALID_ARGUMENT", "model: unknown model 'x'", chat)
    assert (e.status, e.code) == (404, "model_not_found")
    e = error_from_status("RESOURCE_EXHAUSTED", "decode: queue full; retry after 3s", chat)
    assert e.status == 429 and e.headers["Retry-After"] == "3"
    assert e.body()["error"]["type"] == "rate_limit_error"
    assert error_from_status("RESOURCE_EXHAUSTED", "busy", chat, "0.2").headers == {
        "Retry-After": "1"}  # the router's retry-after trailer, in whole seconds
    assert error_from_status("UNAVAILABLE", "prefill: down", chat).status == 503
    assert error_from_status("UNAUTHENTICATED", "unknown API key", chat).status == 401
    assert error_from_status("INTERNAL", "boom", chat).status == 500
    completion = parse_completion({"prompt": [1, 2]})
    assert error_from_status("INVALID_ARGUMENT", "token_ids: bad", completion).param == "prompt"


def test_logprobs_render_in_both_formats_and_clamp_minus_infinity():
    lp = common_pb2.TokenLogprobs(token_id=1, logprob=-0.5, top=[
        common_pb2.Logprob(token_id=1, logprob=-0.5), common_pb2.Logprob(token_id=2,
                                                                         logprob=-math.inf)])
    texts = {1: "a", 2: "é"}.__getitem__
    chat = Renderer(parse_chat({"messages": USER, "logprobs": True, "top_logprobs": 2}),
                    "id", "m", 0, texts)
    content = chat.logprobs([lp])["content"]
    assert content[0]["token"] == "a" and content[0]["top_logprobs"][1] == {
        "token": "é", "logprob": MIN_LOGPROB, "bytes": [0xC3, 0xA9]}
    comp = Renderer(parse_completion({"prompt": "x", "logprobs": 1}), "id", "m", 0, texts)
    out = comp.logprobs([lp, common_pb2.TokenLogprobs(token_id=2, logprob=-3.0)])
    assert out["tokens"] == ["a", "é"] and out["text_offset"] == [0, 1]
    assert out["top_logprobs"][1] == {"é": -3.0}  # the sampled token is always present
    json.dumps(out, allow_nan=False)


# ---- property over request bodies (pure) ----------------------------------------------------

leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8),
                 st.just("\ud800"), st.just(""))
junk = st.recursive(leaf, lambda c: st.lists(c, max_size=3)
                    | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6)
small_ints = st.one_of(st.integers(-3, 8), st.sampled_from([10**6, 2**31, 2**63]))
text = st.text(min_size=1, max_size=20)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                 "content": text})
# Mostly valid values, so that many bodies pass validation ...
valid = {
    "max_tokens": st.integers(1, 4), "max_completion_tokens": st.integers(1, 4),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 20),
    "seed": st.integers(0, 2**40), "n": st.just(1), "stop": st.text(min_size=1, max_size=3)
    | st.lists(st.text(min_size=1, max_size=3), max_size=3), "stream": st.booleans(),
    "ignore_eos": st.booleans(), "stop_token_ids": st.lists(st.integers(0, 100), max_size=2),
    "user": text,
}
# ... and, for a few fields per body, values that are often wrong (near misses or any JSON).
near = {
    "model": st.sampled_from(["", "nope"]), "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "robot", "tool"]), "content": text | junk}),
        max_size=2),
    "prompt": text | st.lists(st.integers(-2, 60000), max_size=4),
    "max_tokens": small_ints, "max_completion_tokens": small_ints,
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-3, 50),
    "seed": st.integers(-(2**64), 2**64), "n": st.integers(-1, 3),
    "stop": st.lists(st.text(max_size=3), max_size=20),
    "stop_token_ids": st.lists(st.integers(-2, 60000), max_size=3),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | junk}),
    "logprobs": st.booleans() | st.integers(-2, 25), "top_logprobs": st.integers(-2, 25),
    "presence_penalty": st.sampled_from([0, 0.0, 1.5, 3]), "echo": st.booleans(),
    "repetition_penalty": st.floats(-1, 3), "min_p": st.floats(-0.5, 1.5),
    "min_tokens": st.integers(-1, 3), "logit_bias": st.dictionaries(
        st.sampled_from(["1", "2", "x"]), st.floats(-200, 200), max_size=2),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                        {"type": "json_schema"}, {"type": "nope"}]),
    "guided_choice": st.lists(st.text(max_size=3), max_size=2),
    "best_of": st.integers(0, 3),
    "tools": st.sampled_from([[TOOL], [TOOL, TOOL], [{"type": "function"}],
                              [{"type": "function", "function": {"name": "a b"}}]]),
    "tool_choice": st.sampled_from(["auto", "none", "required", "any", {
        "type": "function", "function": {"name": "get_weather"}}, {
        "type": "function", "function": {"name": "nope"}}]),
    "parallel_tool_calls": st.booleans(),
}


@st.composite
def bodies(draw, chat: bool, model: str = "") -> dict:
    """A request body for chat or completions: valid fields, then 0-2 fields made doubtful."""
    body: dict = {"messages": draw(st.lists(message, min_size=1, max_size=2))} if chat else \
        {"prompt": draw(text)}
    if model and draw(st.booleans()):
        body["model"] = model
    for name, strategy in valid.items():
        if draw(st.booleans()):
            body[name] = draw(strategy)
    if chat and draw(st.booleans()):
        body["logprobs"] = True
        if draw(st.booleans()):
            body["top_logprobs"] = draw(st.integers(0, 5))
    elif not chat and draw(st.booleans()):
        body["logprobs"] = draw(st.integers(0, 5))
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=2, unique=True)):
        body[name] = draw(near.get(name, junk) | junk)
    return body


@settings(max_examples=400, deadline=None)
@given(data=st.data(), chat=st.booleans())
def test_every_body_parses_or_gets_a_400_naming_a_real_field(data, chat):
    body = data.draw(bodies(chat))
    try:
        (parse_chat if chat else parse_completion)(body)
        event("valid")
    except OpenAIError as e:
        assert e.status == 400, e.body()
        assert e.param is not None and root(e.param) in FIELDS, e.body()


# ---- the HTTP server: a router with HTTP on, and no reachable worker ------------------------

def start_http_router(model_path: str, *extra_args: str):
    """A router process whose workers are unreachable: nothing is generated, so requests that
    pass validation get 503 (gRPC UNAVAILABLE mapped), everything else a 4xx.
    Returns (process, HTTP base URL)."""
    grpc_addr = f"127.0.0.1:{free_port()}"
    dead_p, dead_d = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    # The dead workers stay members (never dropped for missed polls), so the router keeps
    # routing to them and answers UNAVAILABLE, as a router whose workers just died does.
    p = start_process([sys.executable, "-m", "pdserve.router", "--model", model_path,
                       "--address", grpc_addr, "--prefill", dead_p, "--decode", dead_d,
                       "--max-missed-polls", "1000000",
                       "--http-port", "0", "--http-max-body-bytes", str(64 << 10),
                       *extra_args],
                      grpc_addr, timeout_s=120)
    for _ in range(200):  # the ready line follows the health check by a moment
        out = process_output(p)[0]
        if " http=" in out:
            return p, "http://" + out.split(" http=")[1].split()[0]
        time.sleep(0.05)
    stop_process(p)
    raise RuntimeError(f"no http= in the router's ready line: {out!r}")


@pytest.fixture(scope="module")
def http_router(smollm2_gguf_path):
    p, base = start_http_router(smollm2_gguf_path)
    try:
        with httpx.Client(base_url=base, timeout=30) as client:
            yield client
    finally:
        stop_process(p, timeout_s=15)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def still_serving(client: httpx.Client):
    assert client.get("/v1/models").status_code == 200
    assert client.get("/health").status_code == 200


def test_http_errors_have_openai_shape_and_server_keeps_serving(http_router):
    c = http_router
    assert_openai_error(c.post("/v1/chat/completions", content=b'{"messages": ['), 400)
    assert_openai_error(c.post("/v1/completions", content=b"\xff\xfe"), 400)
    assert_openai_error(c.post("/v1/completions", content=b""), 400)
    assert_openai_error(c.post("/v1/completions", content=b"[1, 2]"), 400)
    big = json.dumps({"prompt": "x" * (70 << 10)}).encode()
    assert_openai_error(c.post("/v1/completions", content=big), 413)
    err = assert_openai_error(c.post("/v1/chat/completions",
                                     json={"model": "gpt-4o", "messages": USER}), 404, "model")
    assert err["code"] == "model_not_found"
    assert_openai_error(c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": "9"}),
                        400, "max_tokens")
    assert_openai_error(c.post("/v1/chat/completions", json={"messages": USER, "n": 0}), 400, "n")
    assert_openai_error(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**5}),
                        400, "max_tokens")  # past the context: found by the gRPC path, mapped
    assert_openai_error(c.post("/v1/completions", json={"prompt": [10**6]}), 400, "prompt")
    assert_openai_error(c.get("/v1/nothing-here"), 404)
    assert_openai_error(c.get("/v1/completions"), 405)
    err = assert_openai_error(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}),
                              503)  # valid, but no worker answers
    assert err["type"] == "server_error"
    err = assert_openai_error(c.post("/v1/completions", json={"prompt": "hi", "stream": True}),
                              503)  # a stream that fails before its first token: a real status
    still_serving(c)
    models = c.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), chat=st.booleans())
def test_http_bodies_get_success_or_a_named_400_never_a_500(http_router, data, chat):
    body = data.draw(bodies(chat, os.path.basename(default_model_path())))
    # json.dumps, not httpx's encoder: bodies may hold NaN and Infinity (Python's JSON reads them).
    r = http_router.post("/v1/chat/completions" if chat else "/v1/completions",
                         content=json.dumps(body).encode(),
                         headers={"content-type": "application/json"})
    event(f"HTTP {r.status_code}")
    if r.status_code == 503:  # passed validation; no worker to run it here
        return
    if r.status_code == 404:
        assert r.json()["error"]["code"] == "model_not_found"
        return
    err = assert_openai_error(r, 400)
    assert err["param"] is not None and root(err["param"]) in FIELDS, err


def test_api_keys_and_rate_limits_apply_to_http_too(smollm2_gguf_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEYS", "sk-test-0001:alice")
    p, base = start_http_router(smollm2_gguf_path, "--tenant-rate-rps", "0.01",
                                "--tenant-burst", "1")
    try:
        with httpx.Client(base_url=base, timeout=30) as c:
            body = {"prompt": "hi", "max_tokens": 2}
            err = assert_openai_error(c.post("/v1/completions", json=body), 401)
            assert err["code"] == "invalid_api_key"
            assert_openai_error(c.post("/v1/completions", json=body,
                                       headers={"authorization": "Bearer wrong-key"}), 401)
            # The right key passes the door (then finds no worker here) ...
            key = {"authorization": "Bearer sk-test-0001"}
            assert_openai_error(c.post("/v1/completions", json=body, headers=key), 503)
            # ... once: the tenant's rate limit (burst 1) refuses the next with a retry hint.
            r = c.post("/v1/completions", json=body, headers=key)
            err = assert_openai_error(r, 429)
            assert err["type"] == "rate_limit_error" and int(r.headers["retry-after"]) >= 1
    finally:
        stop_process(p, timeout_s=15)


def test_models_lists_the_model_once_and_accepts_its_aliases(http_router, smollm2_gguf_path):
    name = os.path.basename(smollm2_gguf_path)
    data = http_router.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [name]
    for alias in (name, name.removesuffix(".gguf")):  # valid: 503 (no worker here), not 404
        body = {"model": alias, "prompt": "hi", "max_tokens": 2}
        assert_openai_error(http_router.post("/v1/completions", json=body), 503)


def test_served_name_is_the_one_listed_and_model_defaults_are_applied(smollm2_gguf_path,
                                                                     tiny_llama_dir, tmp_path):
    p, base = start_http_router(smollm2_gguf_path, "--model-name", "smol")
    try:
        with httpx.Client(base_url=base, timeout=30) as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["smol"]
            body = {"model": os.path.basename(smollm2_gguf_path), "prompt": "hi", "max_tokens": 2}
            assert_openai_error(c.post("/v1/completions", json=body), 503)  # still accepted
    finally:
        stop_process(p, timeout_s=15)
    # A model folder whose generation_config.json recommends sampling settings: the router
    # says it applies them to HTTP requests that leave them unset.
    folder = tmp_path / "Qwen2.5-like"  # a dot in a folder name is not an extension
    folder.mkdir()
    for f in os.listdir(tiny_llama_dir):
        if f != "generation_config.json":  # written below: through a link it would change
            (folder / f).symlink_to(os.path.join(tiny_llama_dir, f))  # the shared model's
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20}))
    p, base = start_http_router(str(folder))
    try:
        with httpx.Client(base_url=base, timeout=30) as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["Qwen2.5-like"]
            assert_openai_error(c.post("/v1/completions", json={"model": "Qwen2", "prompt": "hi"}),
                                404)
        out = process_output(p)
        assert "sample with temperature=0.6, top_k=20" in "".join(out), out
    finally:
        stop_process(p, timeout_s=15)
