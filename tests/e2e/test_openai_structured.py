"""Structured outputs, the sampling controls and several choices through the official `openai`
client, on the embedded cluster with the default model (prefill and decode workers: the first
token is sampled on the prefill worker, the rest on the decode worker).

- `client.beta.chat.completions.parse` with Pydantic models (nested objects, arrays, enums,
  numbers with bounds) returns a parsed object every time; JSON mode output parses.
- A constraint that cannot be compiled is a 400 naming the field it came from.
- Exactness: a choice list that holds the unconstrained greedy answer gives that very answer;
  penalties and logit_bias are honoured across the hand-over.
- `echo` with `logprobs` scores the prompt as the completion scores the same tokens.
- `n=3` gives 3 choices, greedy ones equal, seeded ones equal to separate requests with seeds
  seed, seed + 1, seed + 2; `best_of` returns the n most likely.
"""

from __future__ import annotations

import json
from enum import Enum

import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.test_cluster import worker_stats, workers


class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=30)


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    favourite: Colour
    pets: list[Pet] = Field(max_length=2)


class Reading(BaseModel):
    city: str = Field(max_length=20)
    celsius: float = Field(ge=-50, le=60)
    tags: list[str] = Field(max_length=3)


class Choice(BaseModel):
    answer: Colour


SCHEMAS = [
    (Person, "Describe a person called Ada who is 36 and has a cat, as JSON."),
    (Reading, "Give today's weather in Paris as JSON."),
    (Choice, "What colour is the sky? Answer as JSON."),
    (Pet, "My dog Rex is 4. Give him as JSON."),
]


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("schema,question", SCHEMAS, ids=[s.__name__ for s, _ in SCHEMAS])
def test_parse_returns_a_valid_object_for_every_schema(client, model, schema, question):
    for temperature in (0.0, 1.0):
        r = client.beta.chat.completions.parse(model=model, messages=chat(question),
                                               response_format=schema, max_tokens=160,
                                               temperature=temperature, seed=11)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", msg.content
        assert isinstance(msg.parsed, schema), msg.content
        schema.model_validate_json(msg.content)  # bounds, enums and nesting all hold


def test_json_mode_output_parses(client, model):
    for q in ("Give me a JSON object with a name and an age.",
              "List two fruits in a JSON object under the key fruits."):
        r = client.chat.completions.create(model=model, messages=chat(q), max_tokens=200,
                                           temperature=0, response_format={"type": "json_object"})
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_choice_list_holding_the_greedy_answer_gives_it_exactly(client, model):
    q = chat("Is water wet? Answer yes or no.")
    plain = client.chat.completions.create(model=model, messages=q, max_tokens=8, temperature=0)
    text = plain.choices[0].message.content
    got = client.chat.completions.create(model=model, messages=q, max_tokens=8, temperature=0,
                                         extra_body={"guided_choice": [text, "zzz"]})
    assert got.choices[0].message.content == text
    # Streamed, the same text.
    stream = client.chat.completions.create(model=model, messages=q, max_tokens=8,
                                            temperature=0, stream=True,
                                            extra_body={"guided_choice": ["zzz", text]})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"guided_regex": "[0-"}}, "guided_regex"),
    ({"extra_body": {"guided_grammar": "start: undefined_rule"}}, "guided_grammar"),
])
def test_a_constraint_that_cannot_compile_is_a_400_naming_its_field(client, model, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=chat("hi"), max_tokens=4, **body)
    assert err.value.body["param"] == param, err.value.body
    # The server keeps serving.
    ok = client.chat.completions.create(model=model, messages=chat("hi"), max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_logit_bias_and_penalties_shape_the_answer(client, model, smollm2_cluster):
    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.engine.loader import default_model_path

    tok = Tokenizer.from_path(default_model_path())
    q = chat("Say something about cats.")
    base = client.completions.create(model=model, prompt="Cats are", max_tokens=12,
                                     temperature=0)
    forced = tok.encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(model=model, prompt="Cats are", max_tokens=12, temperature=0,
                                  logit_bias={str(forced): 100})
    assert tok.encode(r.choices[0].text, add_special_tokens=False)[:1] == [forced]
    # A strong frequency penalty changes a greedy answer (the engine's tests check the
    # arithmetic against a reference) ...
    r = client.chat.completions.create(model=model, messages=q, max_tokens=60, temperature=0,
                                       frequency_penalty=2.0)
    plain = client.chat.completions.create(model=model, messages=q, max_tokens=60,
                                           temperature=0)
    assert r.choices[0].message.content != plain.choices[0].message.content
    # ... and min_tokens holds off the end of the answer.
    short = client.completions.create(model=model, prompt="Cats are", max_tokens=40,
                                      temperature=0, extra_body={"min_tokens": 30})
    assert short.usage.completion_tokens >= 30
    assert base.choices[0].text  # the plain request answered too


def test_n_choices_share_one_prefill_and_equal_separate_seeded_requests(client, model,
                                                                        smollm2_cluster):
    q = chat("Write a short poem about the sea, the wind and the stars at night.")
    pre = workers(smollm2_cluster, "prefill")[0]
    before = worker_stats(pre).prompt_tokens_computed
    r = client.chat.completions.create(model=model, messages=q, max_tokens=16, temperature=0,
                                       n=3)
    computed = worker_stats(pre).prompt_tokens_computed - before
    texts = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len(set(texts)) == 1  # greedy: every choice the same
    assert computed <= r.usage.prompt_tokens  # one prefill for the three (the prompt, once)
    one = client.chat.completions.create(model=model, messages=q, max_tokens=16, temperature=0)
    assert one.choices[0].message.content == texts[0]
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    seeded = client.chat.completions.create(model=model, messages=q, max_tokens=12,
                                            temperature=1.0, seed=5, n=3, logprobs=True)
    for c in seeded.choices:
        alone = client.chat.completions.create(model=model, messages=q, max_tokens=12,
                                               temperature=1.0, seed=5 + c.index)
        assert c.message.content == alone.choices[0].message.content
    # Streamed: each choice's deltas join to its whole text.
    stream = client.chat.completions.create(model=model, messages=q, max_tokens=12,
                                            temperature=1.0, seed=5, n=3, stream=True)
    joined: dict[int, str] = {}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            joined[c.index] = joined.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2}
    assert [joined[i] for i in range(3)] == [c.message.content for c in
                                              sorted(seeded.choices, key=lambda c: c.index)]


def test_best_of_returns_the_most_likely_choices(client, model):
    r = client.completions.create(model=model, prompt="The ocean is", max_tokens=8,
                                  temperature=1.0, seed=3, n=2, best_of=4, logprobs=0)
    assert len(r.choices) == 2
    scores = [sum(c.logprobs.token_logprobs) for c in sorted(r.choices, key=lambda c: c.index)]
    assert scores[0] >= scores[1]
    for i in range(4):  # each returned choice is one of the four seeds' answers, the best ones
        alone = client.completions.create(model=model, prompt="The ocean is", max_tokens=8,
                                          temperature=1.0, seed=3 + i, logprobs=0)
        s = sum(alone.choices[0].logprobs.token_logprobs)
        if alone.choices[0].text not in [c.text for c in r.choices]:
            assert s <= scores[-1] + 1e-4
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="x", max_tokens=2, n=2, best_of=1)
    assert err.value.body["param"] == "best_of"


def test_echo_returns_the_prompt_before_the_completion(client, model):
    plain = client.completions.create(model=model, prompt="The ocean is", max_tokens=6,
                                      temperature=0)
    r = client.completions.create(model=model, prompt="The ocean is", max_tokens=6,
                                  temperature=0, echo=True)
    assert r.choices[0].text == "The ocean is" + plain.choices[0].text
    stream = client.completions.create(model=model, prompt="The ocean is", max_tokens=6,
                                       temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text
    with pytest.raises(openai.BadRequestError) as err:  # the default model has no FIM tokens
        client.completions.create(model=model, prompt="def f(", suffix="):", max_tokens=4)
    assert err.value.body["param"] == "suffix"


def test_echo_with_logprobs_scores_the_prompt_as_the_completion_scores_it(client, model):
    # As evaluation harnesses ask: the prompt's tokens with their logprobs (the first null),
    # then the completion's. The prompt is prefilled on the prefill worker; the completion's
    # first token there too, from the same logits a longer prompt's last position gives.
    text = "The ocean is deep and"
    r = client.completions.create(model=model, prompt=text, max_tokens=3, temperature=0,
                                  echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + r.usage.completion_tokens == n_prompt + 3
    assert "".join(lp.tokens) == r.choices[0].text and r.choices[0].text.startswith(text)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:])  # top 2, plus the token when not in it
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # The completion's first token, made part of the prompt, gets the very same logprob.
    longer = client.completions.create(model=model, prompt=text + lp.tokens[n_prompt],
                                       max_tokens=1, temperature=0, echo=True, logprobs=0)
    assert longer.usage.prompt_tokens == n_prompt + 1  # it tokenizes as it was generated
    assert longer.choices[0].logprobs.token_logprobs[1:n_prompt + 1] == pytest.approx(
        lp.token_logprobs[1:n_prompt + 1], abs=1e-4)
    # Streamed: the echo with the prompt's logprobs first, then the completion's.
    stream = client.completions.create(model=model, prompt=text, max_tokens=3, temperature=0,
                                       echo=True, logprobs=2, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices and c.choices[0].logprobs]
    assert chunks[0].text == text
    assert [t for c in chunks for t in c.logprobs.tokens] == lp.tokens
    values = [v for c in chunks for v in c.logprobs.token_logprobs]
    assert values[0] is None and values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    # A one-token prompt: its token, with a null logprob, then the completion's.
    one = client.completions.create(model=model, prompt="Hello", max_tokens=1, temperature=0,
                                    echo=True, logprobs=0)
    assert one.usage.prompt_tokens == 1
    assert one.choices[0].logprobs.tokens[0] == "Hello"
    assert one.choices[0].logprobs.token_logprobs[0] is None
    assert len(one.choices[0].logprobs.tokens) == 2
