"""The OpenAI-compatible HTTP API on the embedded cluster, through the official `openai` client.

Streamed and whole chat completions and completions give the gRPC API's text for the same greedy
request; usage and logprobs are reported (logprobs agree with transformers' log_softmax); a client
that leaves a stream early gets its decode aborted and its KV blocks freed; random request bodies
get a success or a 400 naming the field, never a 500.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.tokenizer import Tokenizer
from tests.e2e.test_cluster import generate, worker_stats, workers
from tests.router.test_openai_schema import FIELDS, bodies, root

QUESTION = "Name three colours of the rainbow."
PROMPT = "The three primary colours are"


def test_models_and_health(smollm2_cluster, client, model):
    assert model.endswith(".gguf") or model
    r = httpx.get(f"http://{smollm2_cluster.http_address}/health", timeout=30)
    assert r.status_code == 200


def test_chat_stream_and_whole_equal_grpc_text(smollm2_cluster, client, model):
    ids, text, _, usage = generate(smollm2_cluster.router_address, chat=[QUESTION], max_tokens=24)
    assert text
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=24,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0] in ("stop", "length")
    u = chunks[-1].usage  # include_usage: a last chunk with no choices and the usage
    assert not chunks[-1].choices and all(c.usage is None for c in chunks[:-1])
    assert (u.prompt_tokens, u.completion_tokens) == (usage.prompt_tokens, len(ids))
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    whole = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}],
        max_completion_tokens=24, temperature=0)
    assert whole.choices[0].message.content == text
    assert whole.usage.completion_tokens == len(ids) and whole.choices[0].logprobs is None


def test_completion_stream_and_whole_equal_grpc_text(smollm2_cluster, client, model):
    ids, text, *_ = generate(smollm2_cluster.router_address, prompt=PROMPT, max_tokens=20,
                             stop=[" and"])
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=20,
                                            temperature=0, stop=" and", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0,
                                      stop=[" and"])
    assert whole.choices[0].text == text and whole.usage.completion_tokens == len(ids)


def test_logprobs_count_top1_and_match_transformers(smollm2_cluster, client, model,
                                                    smollm2_gguf_path, smollm2_hf_model):
    import torch

    ids, _, _, usage = generate(smollm2_cluster.router_address, chat=[QUESTION], max_tokens=12,
                                ignore_eos=True)
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=12,
        temperature=0, logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == len(ids) == resp.usage.completion_tokens == 12
    tok = Tokenizer.from_path(smollm2_gguf_path)
    for entry, tid in zip(content, ids):
        assert len(entry.top_logprobs) == 5
        # Greedy: the chosen token is the most likely one, with the very same logprob.
        assert entry.logprob == entry.top_logprobs[0].logprob
        assert entry.token == tok.decode([tid], skip_special_tokens=False)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]),
                        add_special_tokens=False)
    assert len(prompt) == usage.prompt_tokens
    with torch.inference_mode():
        logits = smollm2_hf_model(torch.tensor([prompt + ids])).logits[0].float()
    ref = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    for i, (entry, tid) in enumerate(zip(content, ids)):
        assert abs(entry.logprob - ref[i, tid].item()) < 1e-4
        top = torch.topk(ref[i], 5).values.tolist()
        assert max(abs(a.logprob - b) for a, b in zip(entry.top_logprobs, top)) < 1e-4
    # The completions form: logprobs=k gives k alternatives per token (plus the sampled one).
    comp = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                     logprobs=3)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and max(top.values()) == value
    assert abs(lp.token_logprobs[0] - ref[0, ids[0]].item()) < 1e-4


def test_closing_a_stream_early_aborts_the_decode_and_frees_its_blocks(smollm2_cluster):
    decode = workers(smollm2_cluster, "decode")[0]
    before = worker_stats(decode)
    assert before.num_running == 0
    body = {"prompt": "Count from one to a million:", "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"http://{smollm2_cluster.http_address}/v1/completions",
                         json=body) as r:
            assert r.status_code == 200
            lines = []
            events = r.iter_lines()
            for line in events:
                lines += [line] if line.startswith("data: {") else []
                if len(lines) == 8:
                    break
            assert len(lines) == 8 and '"error"' not in lines[-1], lines
            during = worker_stats(decode)
            if during.num_running != 1:  # say how the stream goes on, to tell why
                rest = [line for line, _ in zip(events, range(400)) if line]
                pytest.fail(f"the decode is not running mid-stream: {during}; the stream went "
                            f"on with {len(rest)} lines, ending {rest[-3:]}")
            assert during.num_free_blocks < during.num_total_blocks
        # Leaving the block closes the connection mid-stream; 4000 tokens would take a minute.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            after = worker_stats(decode)
            if after.num_running == 0 and after.num_free_blocks == after.num_total_blocks:
                break
            time.sleep(0.05)
        assert after.num_running == 0 and after.num_free_blocks == after.num_total_blocks
        assert after.requests_finished == before.requests_finished + 1
        # The worker goes on serving.
        r = http.post(f"http://{smollm2_cluster.http_address}/v1/completions",
                      json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@settings(max_examples=int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "25")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), chat=st.booleans())
def test_random_bodies_succeed_or_get_a_named_400(tiny_cluster, tiny_llama_dir, data, chat):
    body = data.draw(bodies(chat, os.path.basename(tiny_llama_dir)))
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 4  # keep each success short
    r = httpx.post(f"http://{tiny_cluster.http_address}/v1/"
                   f"{'chat/completions' if chat else 'completions'}",
                   content=json.dumps(body).encode(), timeout=120,
                   headers={"content-type": "application/json"})
    if r.status_code == 200:
        if body.get("stream") is True:
            events = [e for e in r.text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]" and '"error"' not in r.text
        else:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        return
    err = r.json()["error"]
    if r.status_code == 404:
        assert err["code"] == "model_not_found"
        return
    assert r.status_code == 400, r.text
    assert err["param"] is not None and root(err["param"]) in FIELDS, err


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(tiny_cluster):
    # As vLLM: the tiny random model never says EOS, so it stops at the context length (512).
    r = httpx.post(f"http://{tiny_cluster.http_address}/v1/chat/completions", timeout=300,
                   json={"messages": [{"role": "user", "content": "Go on."}], "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == 512, body
