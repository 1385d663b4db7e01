"""Structured outputs in the engine: what users rely on.

On the real default model (SmolLM2-135M), greedy: a JSON schema's output always parses and
validates (nested objects, arrays, enums, bounded numbers, nullable fields), JSON mode's is an
object, a regex's fullmatches, a choice's is one of the choices, each ending with the end of
sequence where its grammar does. Exactness: a constraint that admits the unconstrained greedy
output (a regex of its characters' classes) changes no token; one that spells it out byte for
byte gives the same text in the tokenizer's own tokens. The same batch with speculative
decoding (n-gram drafts, which JSON's repeated keys and braces feed) gives the same tokens.

On the tiny Llama whose greedy output repeats: a draft the grammar forbids is never accepted,
whoever proposed it (a drafter built to propose the forbidden token inside otherwise right
drafts; the n-gram drafter), greedy and seeded, with penalties too, and the output equals the
no-speculation one. min_tokens yields to a grammar that is complete. A constraint the engine
cannot use (badly shaped, or one that does not compile) is refused naming the field.
(The prefill -> decode hand-over, resume and progressive KV with a structured output are in
tests/engine/test_logits_controls.py; the grammars themselves in tests/core/test_structured.py.)
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

from pdserve.core.structured import StructuredOutput
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from pdserve.engine.engine import LLMEngine, StepOutput
from pdserve.engine.sampling import InvalidArgumentError, SamplingParams
from pdserve.engine.spec import Draft, Drafter, DraftRequest
from pdserve.engine.tokenizer import Tokenizer

from tests.engine.test_engine import assert_all_free, make_prompts, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 4  # draft tokens per step
NGRAM = SpecConfig(method="ngram", num_speculative_tokens=K, schedule=False)


def make_engine(path: str, spec: SpecConfig | None = None, *, tokenizer=None,
                model_config=None, weights=None) -> LLMEngine:
    return LLMEngine(EngineConfig(path, cache=CacheConfig(block_size_tokens=16, num_blocks=256),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=1024),
                                  spec=spec),
                     model_config=model_config, weights=weights, tokenizer=tokenizer)


def run_batch(engine: LLMEngine, prompts: dict[str, list[int]],
              params: dict[str, SamplingParams]) -> dict[str, tuple[list[int], str]]:
    """Every request in one batch; (tokens, finish reason) per name."""
    for name, p in prompts.items():
        engine.add_request(name, p, params[name])
    log: list[StepOutput] = []
    outs = run(engine, log=log)
    reasons = {o.request_id: o.finish_reason for o in log if o.finished}
    return {name: (outs.get(name, []), reasons[name]) for name in prompts}


def allowed_all_along(grammars, so: StructuredOutput, tokens: list[int]) -> bool:
    """Whether a fresh matcher takes every token (the end of sequence included)."""
    m = grammars.matcher(so)
    return m.consume_tokens(list(tokens)) and not m.is_error()


# ---- the real model ----------------------------------------------------------------------------------
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "skills": {"type": "array", "items": {"enum": ["python", "rust", "go", "sql"]},
                   "minItems": 1, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20},
                                   "zip": {"type": "string", "pattern": r"^\d{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "skills", "address"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object",
        "properties": {"product": {"type": "string", "maxLength": 20},
                       "price": {"type": "number", "minimum": 0.5, "maximum": 100},
                       "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["product", "price", "quantity"], "additionalProperties": False}}},
    "required": ["items"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]},
                   "sunny": {"type": "boolean"},
                   "temperature_c": {"type": "number", "minimum": -30, "maximum": 45},
                   "note": {"anyOf": [{"type": "string", "maxLength": 30}, {"type": "null"}]}},
    "required": ["city", "sunny", "temperature_c", "note"],
    "additionalProperties": False,
}
SCORES = {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 10},
          "minItems": 3, "maxItems": 5}
SCHEMAS = {"person": PERSON, "order": ORDER, "weather": WEATHER, "scores": SCORES}
CHOICES = ["Paris", "London", "Berlin", "Madrid"]
DATE = r"\d{4}-\d{2}-\d{2}"
QUESTIONS = {
    "person": "Describe a software engineer as JSON: name, age, skills and address.",
    "order": "Write a shopping order as JSON with a few items, their prices and quantities.",
    "weather": "Give today's weather in a French city as JSON.",
    "scores": "Rate three movies from 1 to 10 as a JSON array of numbers.",
    "json_object": "Return a JSON object describing the book 1984 with title and author.",
    "date": "On what date did Apollo 11 land on the Moon? Answer as YYYY-MM-DD.",
    "choice": "Which city is the capital of France: Paris, London, Berlin or Madrid?",
    "plain": "Write a Python function that reverses a string.",
}
N_PLAIN = 24


def spelled_out(text: str) -> str:
    """A regex matching exactly `text` (every ASCII non-alphanumeric as a \\x escape)."""
    return "".join(c if c.isalnum() or not c.isascii() else f"\\x{ord(c):02x}" for c in text)


def classes_of(text: str) -> str:
    """A regex matching `text` and every ASCII text of its length with a letter where it has
    a letter, a digit where a digit, blank where blank, punctuation where punctuation."""
    def cls(c: str) -> str:
        if c.isalpha():
            return "[A-Za-z]"
        if c.isdigit():
            return "[0-9]"
        if c in " \t\n":
            return r"[\x20\x09\x0a]"
        return r"[\x21-\x2f\x3a-\x40\x5b-\x60\x7b-\x7e]"
    assert text.isascii()
    return "".join(cls(c) for c in text)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf_path):
    """(path, tokenizer, model config, weights): loaded once, shared by this module's engines."""
    from pdserve.engine.loader import load_checkpoint

    mc, weights = load_checkpoint(smollm2_gguf_path, torch.float32)
    return smollm2_gguf_path, Tokenizer.from_path(smollm2_gguf_path), mc, weights


def smollm2_engine(smollm2, spec: SpecConfig | None = None) -> LLMEngine:
    path, tok, mc, weights = smollm2
    return make_engine(path, spec, tokenizer=tok, model_config=mc, weights=dict(weights))


@pytest.fixture(scope="module")
def real_batch(smollm2):
    """The structured requests on the real model, in one batch with an unconstrained one:
    (prompts, params, (tokens, finish reason) per name, the engine)."""
    _, tok, _, _ = smollm2
    engine = smollm2_engine(smollm2)
    prompts = {k: tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),
                             add_special_tokens=False) for k, q in QUESTIONS.items()}
    plain = SamplingParams(max_tokens=N_PLAIN, ignore_eos=True)
    want_plain = engine.generate([prompts["plain"]], plain)[0]
    text = tok.decode(want_plain)
    assert 2 not in want_plain and text.isascii() and tok.encode(text, add_special_tokens=False)
    params = {k: SamplingParams(max_tokens=160, structured_output=StructuredOutput(
        "json_schema", json.dumps(s))) for k, s in SCHEMAS.items()}
    params["json_object"] = SamplingParams(max_tokens=160,
                                           structured_output=StructuredOutput("json_object"))
    params["date"] = SamplingParams(max_tokens=16,
                                    structured_output=StructuredOutput("regex", DATE))
    params["choice"] = SamplingParams(max_tokens=8, structured_output=StructuredOutput(
        "choice", json.dumps(CHOICES)))
    params["plain"] = plain
    # Exactness: a regex admitting the unconstrained output changes none of its tokens.
    for name, rx in (("spelled", spelled_out(text)), ("classes", classes_of(text))):
        prompts[name] = prompts["plain"]
        params[name] = replace(plain, ignore_eos=False,
                               structured_output=StructuredOutput("regex", rx))
    outs = run_batch(engine, prompts, params)
    assert outs["plain"][0] == want_plain
    assert_all_free(engine)
    return prompts, params, outs, engine


def test_json_schema_output_parses_and_validates(smollm2, real_batch):
    import jsonschema  # a test dependency (pyproject's `test` extra)
    _, tok, _, _ = smollm2
    _, _, outs, _ = real_batch
    for name, schema in SCHEMAS.items():
        tokens, reason = outs[name]
        assert reason == "stop" and tokens[-1] == 2, (name, tok.decode(tokens))
        doc = json.loads(tok.decode(tokens[:-1]))
        jsonschema.validate(doc, schema)
    tokens, reason = outs["json_object"]
    assert reason == "stop" and tokens[-1] == 2
    assert isinstance(json.loads(tok.decode(tokens[:-1])), dict)


def test_regex_and_choice_outputs_match(smollm2, real_batch):
    _, tok, _, _ = smollm2
    _, _, outs, _ = real_batch
    tokens, reason = outs["date"]
    assert reason == "stop" and re.fullmatch(DATE, tok.decode(tokens[:-1]))
    tokens, reason = outs["choice"]
    assert reason == "stop" and tok.decode(tokens[:-1]) == "Paris"  # the model knows it


def test_a_constraint_admitting_the_greedy_output_changes_no_token(smollm2, real_batch):
    _, tok, _, _ = smollm2
    _, _, outs, _ = real_batch
    plain, _ = outs["plain"]
    assert len(plain) == N_PLAIN
    assert outs["classes"] == outs["plain"]
    # Where the grammar leaves a single way on (here, every byte), the grammar engine admits
    # only the tokenizer's own (canonical) tokens for those bytes: the text is the same, the
    # tokens are the same wherever the model's were canonical. (SmolLM2 writes the closing
    # "\n\n" as two "\n" tokens, the tokenizer as one.)
    spelled, reason = outs["spelled"]
    assert reason == "stop" and spelled[-1] == 2
    assert tok.decode(spelled[:-1]) == tok.decode(plain)
    assert spelled[:-1] == tok.encode(tok.decode(plain), add_special_tokens=False)


def test_structured_output_is_the_same_with_speculation(smollm2, real_batch):
    prompts, params, want, plain_engine = real_batch
    engine = smollm2_engine(smollm2, NGRAM)
    got = run_batch(engine, prompts, params)
    assert got == want
    s = engine.stats()
    assert s["spec_decode_num_accepted_tokens"] > 0  # JSON's structure feeds the n-grams
    grammars = plain_engine.runner.guides.grammars
    for name, (tokens, _) in got.items():
        so = params[name].structured_output
        if so is not None:
            assert allowed_all_along(grammars, so, tokens), name
    assert_all_free(engine)


# ---- drafts the grammar forbids, on the tiny repeating model ------------------------------------
LOWER = StructuredOutput("regex", r"[a-z ]+")  # lower-case letters and spaces
N_SPEC = 24
SPEC_PROMPTS = make_prompts([7, 12], seed=21)


class ForbiddenInside(Drafter):
    """Proposes a request's known (constrained) continuation with one token replaced by a token
    the grammar forbids, at a position that moves with the history's length (sometimes past the
    draft: then every draft is right)."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], bad: int) -> None:
        self.truth = truth
        self.bad = bad
        self.proposed_bad = 0

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            d: list[int] = []
            for prompt, full in self.truth.items():
                h = r.token_ids
                if tuple(h[:len(prompt)]) == prompt and full[:len(h) - len(prompt)] == \
                        h[len(prompt):]:
                    d = list(full[len(h) - len(prompt):][:r.k])
                    at = len(h) % (r.k + 1)
                    if at < len(d):
                        d[at] = self.bad
                        self.proposed_bad += 1
                    break
            out.append(Draft(d))
        return out


def spec_params() -> list[SamplingParams]:
    greedy = SamplingParams(max_tokens=N_SPEC, structured_output=LOWER)
    seeded = replace(greedy, temperature=0.1, seed=99)
    penalised = replace(greedy, repetition_penalty=1.2, frequency_penalty=0.2,
                        presence_penalty=0.1)
    return [greedy, seeded, penalised, replace(penalised, temperature=0.1, seed=5)]


@pytest.fixture(scope="module")
def no_spec(repeaty_llama_dir):
    """(prompts, params, outputs without speculation, the unconstrained greedy outputs)."""
    engine = make_engine(repeaty_llama_dir)
    prompts, params = {}, {}
    for i, p in enumerate(spec_params()):
        for j, prompt in enumerate(SPEC_PROMPTS):
            prompts[f"{i}.{j}"] = [3 + i] + prompt  # a prompt of its own per request
            params[f"{i}.{j}"] = p
    want = run_batch(engine, prompts, params)
    free = engine.generate(list(prompts.values()),
                           SamplingParams(max_tokens=N_SPEC, ignore_eos=True))
    return prompts, params, want, free, engine.runner.guides.grammars


def test_a_forbidden_draft_is_never_accepted(repeaty_llama_dir, no_spec):
    prompts, params, want, free, grammars = no_spec
    bad = free[0][0]  # the model's favourite, which the grammar forbids
    assert not allowed_all_along(grammars, LOWER, [bad])
    assert all(w[0] != f for w, f in zip(want.values(), free))
    engine = make_engine(repeaty_llama_dir, NGRAM)
    # Greedy and seeded alike: the no-speculation tokens are what the target draws.
    drafter = ForbiddenInside({tuple(prompts[n]): want[n][0] for n in want}, bad)
    engine.runner.drafter = drafter
    got = run_batch(engine, prompts, params)
    assert got == want
    assert drafter.proposed_bad > 0
    s = engine.stats()
    assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"]
    for name, (tokens, _) in got.items():
        assert bad not in tokens and allowed_all_along(grammars, LOWER, tokens), name
    assert_all_free(engine)


def test_ngram_speculation_keeps_structured_tokens(repeaty_llama_dir, no_spec):
    prompts, params, want, _, grammars = no_spec
    # The prompts repeat each one's constrained output: the n-grams propose it, and after it
    # the prompt's next token, which may be anything.
    looped = {n: p + want[n][0][:6] + p + want[n][0][:6] for n, p in prompts.items()}
    engine = make_engine(repeaty_llama_dir)
    want_looped = run_batch(engine, looped, params)
    engine = make_engine(repeaty_llama_dir, NGRAM)
    got = run_batch(engine, looped, params)
    assert got == want_looped
    assert engine.stats()["spec_decode_num_draft_tokens"] > 0
    for name, (tokens, _) in got.items():
        assert allowed_all_along(grammars, LOWER, tokens), name
    assert_all_free(engine)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_min_tokens_yields_to_a_complete_grammar(tiny_llama_dir, temperature):
    """A choice is complete after a token or two; min_tokens then has nothing to hold the end
    of sequence back for: the request ends there (neither a NaN distribution nor a token the
    grammar forbids)."""
    so = StructuredOutput("choice", json.dumps(["yes", "no"]))
    engine = make_engine(tiny_llama_dir)
    tok = Tokenizer.from_path(tiny_llama_dir)
    p = SamplingParams(max_tokens=8, min_tokens=5, temperature=temperature, seed=1,
                       structured_output=so, repetition_penalty=1.1)
    out = run_batch(engine, {f"r{i}": prompt for i, prompt in
                             enumerate(make_prompts([3, 8, 5], seed=2))}, {f"r{i}": p
                                                                           for i in range(3)})
    for tokens, reason in out.values():
        assert reason == "stop" and tokens[-1] == 2 and tok.decode(tokens[:-1]) in ("yes", "no")
        assert allowed_all_along(engine.runner.guides.grammars, so, tokens)
    assert_all_free(engine)


# ---- a constraint the engine cannot use ---------------------------------------------------------
@pytest.mark.parametrize("so", [
    StructuredOutput("choice", "[]"),
    StructuredOutput("json_schema", "{nope"),
    StructuredOutput("regex", "x" * (64 * 1024 + 1)),
    StructuredOutput("table", "a|b"),
], ids=["empty-choice-list", "schema-not-json", "too-large", "unknown-kind"])
def test_a_badly_shaped_constraint_is_refused_by_the_engine(tiny_llama_dir, so):
    engine = make_engine(tiny_llama_dir)
    with pytest.raises(InvalidArgumentError) as info:
        engine.add_request("bad", [5, 6, 7], SamplingParams(max_tokens=4, structured_output=so))
    assert info.value.field.split(".")[0] == "structured_output"
    assert not engine.has_work()
    assert len(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0]) == 4


@pytest.mark.parametrize("so", [StructuredOutput("regex", "(ab"),
                                StructuredOutput("json_schema", '{"type": "foo"}'),
                                StructuredOutput("grammar", "start: x")],
                         ids=["bad-regex", "bad-schema", "bad-grammar"])
def test_a_constraint_that_cannot_compile_is_refused_by_the_engine(tiny_llama_dir, so):
    engine = make_engine(tiny_llama_dir)
    with pytest.raises(InvalidArgumentError) as info:
        engine.add_request("bad", [5, 6, 7], SamplingParams(max_tokens=4, structured_output=so))
    assert info.value.field == "structured_output"
    assert len(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0]) == 4
