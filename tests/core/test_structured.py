"""Structured outputs without a model (`pdserve.core.structured`): what each constraint admits,
token by token through its matcher over the default model's tokenizer, and the errors a bad
one gets, each naming the field (invariant 7).

The matcher is what the sampler masks with, so admitting a string here means the engine may
emit it and refusing one means it never will (tests/engine/test_guided.py runs the model).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from pdserve.core.errors import InvalidArgumentError
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.structured import (
    KINDS, MAX_CHOICES, MAX_SPEC_BYTES, Grammars, StructuredOutput, ascii_classes)

FIELD = "structured_output"


@pytest.fixture(scope="module")
def tok():
    from pdserve.engine.loader import default_model_path
    from pdserve.engine.tokenizer import Tokenizer  # torch-free, as in the router

    return Tokenizer.from_path(default_model_path())


@pytest.fixture(scope="module")
def grammars(tok) -> Grammars:
    return Grammars(tok.backend.to_str(), tok.vocab_size, list(tok.eos_token_ids))


def admits(grammars: Grammars, tok, so: StructuredOutput, text: str) -> bool:
    """Whether the constraint's matcher takes `text`'s tokens and may end right after."""
    m = grammars.matcher(so)
    ok = m.consume_tokens(tok.encode(text, add_special_tokens=False))
    return ok and not m.is_error() and m.is_accepting()


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1.5},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
        "address": {"type": "object", "properties": {"zip": {"type": "string",
                                                             "pattern": r"^\d{5}$"}},
                    "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("so, text, ok", [
    # JSON mode: any object, nothing else, whitespace bounded.
    (StructuredOutput("json_object"), '{}', True),
    (StructuredOutput("json_object"), '{"a": [1, 2.5, {"b": null}], "c": "d"}', True),
    (StructuredOutput("json_object"), '{' + " " * 10 + '}', True),
    (StructuredOutput("json_object"), '{' + " " * 40 + '}', False),
    (StructuredOutput("json_object"), '[1]', False),
    (StructuredOutput("json_object"), '"x"', False),
    (StructuredOutput("json_object"), '{"a": 1} and more', False),
    (StructuredOutput("json_object"), '{"a": 1', False),
    # A schema: nesting, enums, bounds, required and extra keys, ASCII pattern classes.
    (StructuredOutput("json_schema", json.dumps(PERSON)),
     '{"name": "Al", "age": 7, "score": 1.25, "role": "user", "tags": ["a", "b"], '
     '"address": {"zip": "12345"}}', True),
    # Keys come in the schema's order (the grammar engine's default, as vLLM's engines).
    (StructuredOutput("json_schema", json.dumps(PERSON)), '{"age": 7, "name": "Al", '
     '"role": "user"}', False),
    (StructuredOutput("json_schema", json.dumps(PERSON)), '{"name": "Al", "age": 7, '
     '"role": "user"}', True),
    (StructuredOutput("json_schema", json.dumps(PERSON)), '{"name": "Al", "age": 121, '
     '"role": "user"}', False),
    (StructuredOutput("json_schema", json.dumps(PERSON)), '{"name": "Al", "age": -1, '
     '"role": "user"}', False),
    (StructuredOutput("json_schema", json.dumps(PERSON)), '{"name": "Al", "age": 7.5, '
     '"role": "user"}', False),
    (StructuredOutput("json_schema", json.dumps(PERSON)), '{"name": "Al", "age": 7, '
     '"role": "root"}', False),
    (StructuredOutput("json_schema", json.dumps(PERSON)), '{"name": "Al", "age": 7}', False),
    (StructuredOutput("json_schema", json.dumps(PERSON)), '{"name": "Al", "age": 7, '
     '"role": "user", "x": 1}', False),
    (StructuredOutput("json_schema", json.dumps(PERSON)), '{"name": "Al", "age": 7, '
     '"role": "user", "score": 0}', False),
    (StructuredOutput("json_schema", json.dumps(PERSON)), '{"name": "Al", "age": 7, '
     '"role": "user", "score": 1.6}', False),
    (StructuredOutput("json_schema", json.dumps(PERSON)), '{"name": "Al", "age": 7, '
     '"role": "user", "tags": ["a", "b", "c"]}', False),
    (StructuredOutput("json_schema", json.dumps(PERSON)), '{"name": "Al", "age": 7, '
     '"role": "user", "address": {"zip": "1234"}}', False),
    (StructuredOutput("json_schema", json.dumps(PERSON)), '{"name": "Al", "age": 7, '
     '"role": "user", "address": {"zip": "١٢٣٤٥"}}', False),  # Arabic-Indic digits
    (StructuredOutput("json_schema", json.dumps(PERSON)), '{"name": "Alexander the Great", '
     '"age": 7, "role": "user"}', False),  # maxLength
    # A regex matches the whole output, with ASCII classes.
    (StructuredOutput("regex", "ab+c"), "abbbc", True),
    (StructuredOutput("regex", "ab+c"), "abbbcx", False),
    (StructuredOutput("regex", "ab+c"), "xabc", False),
    (StructuredOutput("regex", "ab+c"), "ab", False),
    (StructuredOutput("regex", r"\d{3}-\w+"), "123-ab_9", True),
    (StructuredOutput("regex", r"\d{3}"), "١٢٣", False),
    (StructuredOutput("regex", r"[\d]+\s[^\d]"), "42 x", True),
    # A choice is one of its strings exactly, whatever characters they hold.
    (StructuredOutput("choice", json.dumps(["yes", "no"])), "yes", True),
    (StructuredOutput("choice", json.dumps(["yes", "no"])), "ye", False),
    (StructuredOutput("choice", json.dumps(["yes", "no"])), "yes!", False),
    (StructuredOutput("choice", json.dumps(["yes", "no"])), "maybe", False),
    (StructuredOutput("choice", json.dumps(['say "hi"', "a\\b", "two\nlines", "ünï"])),
     'say "hi"', True),
    (StructuredOutput("choice", json.dumps(['say "hi"', "a\\b", "two\nlines", "ünï"])),
     "a\\b", True),
    (StructuredOutput("choice", json.dumps(['say "hi"', "a\\b", "two\nlines", "ünï"])),
     "two\nlines", True),
    (StructuredOutput("choice", json.dumps(['say "hi"', "a\\b", "two\nlines", "ünï"])),
     "ünï", True),
    (StructuredOutput("choice", json.dumps(['say "hi"', "a\\b", "two\nlines", "ünï"])),
     "say \\\"hi\\\"", False),
    # A grammar: Lark, or GBNF as vLLM takes it.
    (StructuredOutput("grammar", 'start: "a" NUM\nNUM: /[0-9]+/'), "a42", True),
    (StructuredOutput("grammar", 'start: "a" NUM\nNUM: /[0-9]+/'), "b42", False),
    (StructuredOutput("grammar", 'root ::= "x" | "y" digits\ndigits ::= [0-9]+'), "y12", True),
    (StructuredOutput("grammar", 'root ::= "x" | "y" digits\ndigits ::= [0-9]+'), "xy", False),
], ids=lambda v: v if isinstance(v, bool) else None)
def test_a_constraint_admits_exactly_its_language(grammars, tok, so, text, ok):
    assert admits(grammars, tok, so, text) is ok


@pytest.mark.parametrize("rx, want", [
    (r"\d+", "[0-9]+"),
    (r"\w", "[0-9A-Za-z_]"),
    (r"\s", "[ \\t\\n\\r\\f\\v]"),
    (r"[\d.]", "[0-9.]"),
    (r"[^\w-]", "[^0-9A-Za-z_-]"),
    (r"[]\d]", "[]0-9]"),  # a leading ] is a literal: the class goes on
    (r"[^]\d]x\d", "[^]0-9]x[0-9]"),
    (r"\\d", r"\\d"),  # an escaped backslash, then a literal d
    (r"\[\d\]", r"\[[0-9]\]"),  # escaped brackets open no class
    (r"\D\p{L}", r"\D\p{L}"),  # anything else stays as written
])
def test_ascii_classes(rx, want):
    assert ascii_classes(rx) == want
    if "\\p" not in rx:  # the rewrite means the same as Python's ASCII classes
        for s in ["7", "x", "_", " ", "\t", "-", "]", "\\d", "[5]", "٣", "é", "]x5"]:
            assert bool(re.fullmatch(want, s)) == bool(re.fullmatch(rx, s, re.ASCII)), s


def _shape_errors() -> list:
    big = "x" * (MAX_SPEC_BYTES + 1)
    return [
        pytest.param(StructuredOutput("xml", "<a/>"), id="unknown-kind"),
        pytest.param(StructuredOutput("json_schema", ""), id="empty-schema"),
        pytest.param(StructuredOutput("json_schema", "{not json"), id="schema-not-json"),
        pytest.param(StructuredOutput("json_schema", "[1, 2]"), id="schema-not-an-object"),
        pytest.param(StructuredOutput("json_schema", "[" * 5000 + "]" * 5000),
                     id="schema-json-too-deep"),
        pytest.param(StructuredOutput("json_schema", json.dumps({"description": big})),
                     id="schema-too-large"),
        pytest.param(StructuredOutput("regex", ""), id="empty-regex"),
        pytest.param(StructuredOutput("regex", big), id="regex-too-large"),
        pytest.param(StructuredOutput("grammar", ""), id="empty-grammar"),
        pytest.param(StructuredOutput("grammar", big), id="grammar-too-large"),
        pytest.param(StructuredOutput("choice", "[]"), id="empty-choice-list"),
        pytest.param(StructuredOutput("choice", '["a", ""]'), id="empty-choice"),
        pytest.param(StructuredOutput("choice", '["a", 3]'), id="choice-not-a-string"),
        pytest.param(StructuredOutput("choice", '"a"'), id="choices-not-a-list"),
        pytest.param(StructuredOutput("choice", "[a, b]"), id="choices-not-json"),
        pytest.param(StructuredOutput("choice", json.dumps(["c%d" % i
                                                            for i in range(MAX_CHOICES + 1)])),
                     id="too-many-choices"),
        pytest.param(StructuredOutput("choice", json.dumps(["x" * 1000] * 70)),
                     id="choices-too-large"),
        pytest.param(StructuredOutput("grammar", "start: \ud800"), id="lone-surrogate"),
        pytest.param(StructuredOutput("x" * 3000), id="kind-long-and-unknown"),
    ]


def _compile_errors() -> list:
    nested = '{"type":"array","items":' * 700 + '{"type":"integer"}' + "}" * 700
    return [
        pytest.param(StructuredOutput("regex", "(ab"), id="regex-unclosed-group"),
        pytest.param(StructuredOutput("regex", "a{2,1}"), id="regex-bad-repetition"),
        pytest.param(StructuredOutput("regex", "(" * 20000 + ")" * 20000),
                     id="regex-too-deep"),
        pytest.param(StructuredOutput("json_schema", '{"type": "foo"}'), id="schema-bad-type"),
        pytest.param(StructuredOutput("json_schema", '{"$ref": "#/definitions/none"}'),
                     id="schema-dangling-ref"),
        pytest.param(StructuredOutput("json_schema", '{"const": -9223372036854775809}'),
                     id="schema-integer-past-int64"),
        pytest.param(StructuredOutput("json_schema", '{"type": "integer", "minimum": 5, '
                                      '"maximum": 1}'), id="schema-unsatisfiable"),
        pytest.param(StructuredOutput("json_schema", '{"type": "object", "properties": '
                                      '{"a": 5}}'), id="schema-property-not-a-schema"),
        pytest.param(StructuredOutput("json_schema", json.dumps(
            {"type": "string", "pattern": "(("})), id="schema-bad-pattern"),
        pytest.param(StructuredOutput("json_schema", nested), id="schema-nested-too-deeply"),
        pytest.param(StructuredOutput("grammar", "start: x"), id="grammar-unknown-rule"),
        pytest.param(StructuredOutput("grammar", "::= ::="), id="grammar-does-not-parse"),
        pytest.param(StructuredOutput("grammar", "start: " + "(" * 20000 + '"a"' + ")" * 20000),
                     id="grammar-too-deep"),
    ]


@pytest.mark.parametrize("so", _shape_errors())
def test_a_badly_shaped_constraint_is_refused_naming_the_field(grammars, so):
    for check in (so.validate, SamplingParams(structured_output=so).validate,
                  lambda: grammars.check(so)):
        with pytest.raises(InvalidArgumentError) as info:
            check()
        assert info.value.field.split(".")[0] == FIELD
    assert info.value.field == (f"{FIELD}.kind" if so.kind not in KINDS else FIELD)
    assert len(str(info.value)) < 500  # a long value is not echoed whole


@pytest.mark.parametrize("so", _compile_errors())
def test_a_constraint_that_cannot_compile_is_refused_naming_the_field(grammars, so):
    so.validate()  # the shape is fine: compiling is what fails
    compiled = grammars.compiled
    for _ in range(2):  # a failure is not cached as a grammar
        with pytest.raises(InvalidArgumentError) as info:
            grammars.check(so)
        assert info.value.field == FIELD
        assert len(str(info.value)) < 500  # the compiler's message, cut short
    assert grammars.compiled == compiled


def test_grammars_compile_once_per_constraint_and_stay_bounded(tok):
    g = Grammars(tok.backend.to_str(), tok.vocab_size, list(tok.eos_token_ids),
                 cache_size=2)
    a, b, c = (StructuredOutput("regex", rx) for rx in ("a+", "b+", "c+"))
    first, second = g.matcher(a), g.matcher(a)
    g.check(a)
    assert g.compiled == 1
    # Each request's matcher is its own: one's tokens never move another's.
    assert first.consume_tokens(tok.encode("aaa", add_special_tokens=False))
    assert second.is_accepting() is False and not second.is_error()
    assert second.consume_tokens(tok.encode("a", add_special_tokens=False))
    g.check(b)
    g.check(a)  # a is the most recent now; c evicts b
    g.check(c)
    assert g.compiled == 3 and len(g._cache) == 2
    g.check(a)
    assert g.compiled == 3
    g.check(b)
    assert g.compiled == 4


def test_structured_imports_without_torch():
    code = ("import sys, pdserve.core.structured; "
            "assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
