"""Tool calling through the official `openai` client, on real clusters.

On the default model (SmolLM2, whose template knows no tools: pdserve's own rendering), greedy,
after a conversation in which the assistant called `get_weather` twice: a named tool_choice
forces the call (whole and streamed alike), the tool's result goes back as a `tool` turn and
the model answers with it; with `auto` the model calls the function of its own accord. On a
random Qwen2-family model with a Hermes-style template and `<tool_call>` tokens of its own,
a named tool_choice still gives a call whose arguments follow the function's schema: the
grammar forces it.
"""

from __future__ import annotations

import json
import os

import jsonschema
import openai
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from pdserve.launcher.local import LocalCluster
from tests.conftest import SMOLLM2_VOCAB_SIZE, make_tiny_hf_model
from tests.e2e.conftest import cluster_spec
from tests.router.test_openai_tools import HERMES_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def weather_call(i: int, city: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": f"call_{i}", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}


def weather_result(i: int, celsius: int, sky: str) -> dict:
    return {"role": "tool", "tool_call_id": f"call_{i}",
            "content": json.dumps({"temperature_c": celsius, "sky": sky})}


# Two earlier rounds of ask, call, result, answer; then a new question.
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}, weather_call(1, "Paris"),
        weather_result(1, 18, "sunny"),
        {"role": "assistant", "content": "It is 18 degrees and sunny in Paris."},
        {"role": "user", "content": "What is the weather in Berlin?"}, weather_call(2, "Berlin"),
        weather_result(2, 12, "rainy"),
        {"role": "assistant", "content": "It is 12 degrees and rainy in Berlin."},
        {"role": "user", "content": "What is the weather in Tokyo?"}]


def schema_of(tool: dict) -> dict:
    return tool["function"]["parameters"]


def streamed_calls(chunks) -> tuple[str, list[tuple[str, str, str]], str]:
    """(content, [(id, name, arguments)], finish_reason) put together from stream chunks."""
    content, calls, finish = "", [], ""
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or ():
            if t.id is not None:
                assert t.index == len(calls) and t.type == "function"
                calls.append([t.id, t.function.name, t.function.arguments or ""])
            else:
                assert t.index == len(calls) - 1 and t.function.name is None
                calls[-1][2] += t.function.arguments
        finish = c.choices[0].finish_reason or finish
    return content, [tuple(c) for c in calls], finish


def test_named_tool_choice_round_trip(client, model):
    ask = dict(model=model, messages=CHAT, tools=[WEATHER], tool_choice=NAMED, temperature=0,
               max_tokens=64)
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls" and not whole.message.content
    (call,) = whole.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema_of(WEATHER))
    assert args == {"city": "Tokyo"}
    # Streamed: the name first, then arguments that add up to the whole response's.
    content, calls, finish = streamed_calls(client.chat.completions.create(**ask, stream=True))
    assert (content, finish) == ("", "tool_calls")
    assert [(name, arguments) for _, name, arguments in calls] == \
        [("get_weather", call.function.arguments)]
    assert calls[0][0].startswith("call_")
    # The result goes back as a tool turn; the model answers with it.
    answer = client.chat.completions.create(
        model=model, tools=[WEATHER], temperature=0, max_tokens=24, messages=[
            *CHAT, whole.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id,
             "content": json.dumps({"temperature_c": 25, "sky": "cloudy"})}]).choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "25" in answer.message.content and "Tokyo" in answer.message.content


def test_auto_tool_choice_calls_when_the_model_does(client, model):
    whole = client.chat.completions.create(model=model, messages=CHAT, tools=[WEATHER],
                                           temperature=0, max_tokens=64).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Tokyo"}


# ---- a random Qwen2-family model: the grammar alone makes the call -----------------------

PLAN = {"type": "function", "function": {
    "name": "plan_trip", "description": "Plan a trip",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}


def qwen2_with_tools(tmp_dir) -> str:
    """A tiny random Qwen2 checkpoint whose tokenizer has `<tool_call>` and `</tool_call>` as
    tokens of their own (as Qwen2's) and a Hermes-style template that renders tools."""
    path = make_tiny_hf_model(tmp_dir, "qwen2", vocab_size=SMOLLM2_VOCAB_SIZE + 2)
    tok_file = os.path.join(path, "tokenizer.json")
    backend = BackendTokenizer.from_file(tok_file)
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t in ("<tool_call>", "</tool_call>")])
    backend.save(tok_file)
    cfg_file = os.path.join(path, "tokenizer_config.json")
    with open(cfg_file, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["chat_template"] = HERMES_TEMPLATE
    with open(cfg_file, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    jinja = os.path.join(path, "chat_template.jinja")  # it would win over the config's
    if os.path.exists(jinja):
        os.remove(jinja)
    return path


def test_named_tool_choice_forces_a_valid_call_on_a_random_qwen2_model(tmp_path_factory):
    path = qwen2_with_tools(tmp_path_factory.mktemp("qwen2_tools"))
    with LocalCluster(cluster_spec(path)) as cluster:
        client = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused",
                               max_retries=0, timeout=300)
        ask = dict(model=client.models.list().data[0].id, temperature=0, tools=[WEATHER, PLAN],
                   tool_choice={"type": "function", "function": {"name": "plan_trip"}},
                   messages=[{"role": "user", "content": "Plan me a short trip."}])
        whole = client.chat.completions.create(**ask).choices[0]
        assert whole.finish_reason == "tool_calls", whole
        (call,) = whole.message.tool_calls
        assert call.function.name == "plan_trip"
        jsonschema.validate(json.loads(call.function.arguments), schema_of(PLAN))
        _, calls, finish = streamed_calls(client.chat.completions.create(**ask, stream=True))
        assert finish == "tool_calls"
        assert [c[1:] for c in calls] == [("plan_trip", call.function.arguments)]


def test_the_bench_client_times_every_chunk_of_a_streamed_tool_call(smollm2_cluster, client,
                                                                     model):
    """`pdserve bench serve`'s client counts the chunk that names the function and every
    argument delta as chunks with text, and reads the prompt tokens from the usage."""
    from pdserve.bench import serve_client
    from pdserve.bench.serve_workload import Request

    ask = dict(messages=CHAT, tools=[WEATHER], tool_choice=NAMED, temperature=0, max_tokens=64)
    row = serve_client.stream_one(smollm2_cluster.http_address, Request(
        "/v1/chat/completions", {**ask, "stream": True,
                                 "stream_options": {"include_usage": True}}, 64), model, 300)
    chunks = list(client.chat.completions.create(model=model, **ask, stream=True,
                                                 stream_options={"include_usage": True}))
    with_calls = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert row["error"] is None and row["finish_reason"] == "tool_calls"
    assert len(with_calls) >= 2  # the name, then at least one delta of arguments
    assert len(row["chunk_times_s"]) == len(with_calls)
    assert row["ttft_s"] == row["chunk_times_s"][0]
    assert row["prompt_tokens"] == chunks[-1].usage.prompt_tokens > 0
    assert row["output_tokens"] == chunks[-1].usage.completion_tokens
