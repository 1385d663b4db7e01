"""Structured outputs: the constraint a request's output must match, and its compiled grammars.

Owns `StructuredOutput` (what a request asks: a JSON object, a JSON schema, a regex, a choice
list or a grammar), its translation to one grammar for the grammar engine (llguidance), and
`Grammars`: a tokenizer's compiled grammars, built once per constraint and kept in a bounded
cache, from which every request gets a fresh matcher. The router checks a constraint with it
before admitting the request (a 400 naming the field); the worker that samples masks every
token with the request's matcher. Torch-free: the router has no torch.
Must not sample or mask logits: `pdserve.engine.guided` applies a matcher's masks.

Why llguidance: on the 2-core build machine, with the default model's 49k vocabulary, it
compiles a nested schema in about 2 ms (xgrammar: about 21 ms) and masks a token in about
27 us (xgrammar: about 4 us, far below a decode step of 20-200 ms either way); it is one Rust
wheel with no dependencies, so the torch-free router can compile-check a schema, while
xgrammar needs torch, transformers and tvm-ffi.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.core.errors import InvalidArgumentError

if TYPE_CHECKING:
    import llguidance


def _llg():
    """llguidance, imported at first use: a process that never compiles a grammar (an
    emulated worker, a storage node) does not pay its memory."""
    import llguidance

    return llguidance

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_SPEC_BYTES = 64 * 1024  # a schema, pattern, choice list or grammar, as text
MAX_CHOICES = 1024
FIELD = "structured_output"

# JSON as models write it: whitespace between tokens is free but bounded, so that a weak model
# cannot fill max_tokens with blank lines inside an object. (Tool-call arguments use it too.)
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,32}"}


@dataclass(frozen=True)
class StructuredOutput:
    kind: str  # one of KINDS
    spec: str = ""  # the schema (JSON text), pattern, choices (JSON array) or grammar

    def validate(self) -> None:
        """Shape only (kind, size, JSON text where JSON is due); `Grammars.check` compiles."""
        if self.kind not in KINDS:
            raise InvalidArgumentError(f"{FIELD}.kind", f"must be one of {', '.join(KINDS)}, "
                                       f"got {_short(repr(self.kind), 40)}")
        try:
            size = len(self.spec.encode("utf-8"))
        except UnicodeEncodeError:  # JSON may carry lone surrogates; no grammar takes them
            raise InvalidArgumentError(FIELD, "must be valid Unicode text (no lone "
                                       "surrogates)") from None
        if size > MAX_SPEC_BYTES:
            raise InvalidArgumentError(FIELD, f"the {self.kind} is {size} bytes; at most "
                                       f"{MAX_SPEC_BYTES}")
        if self.kind == "json_object":
            return
        if not self.spec:
            raise InvalidArgumentError(FIELD, f"a {self.kind} must not be empty")
        if self.kind == "json_schema":
            _json_schema(self.spec)
        elif self.kind == "choice":
            _choices(self.spec)

    def grammar(self) -> str:
        """The llguidance grammar for this constraint (valid shape assumed: `validate`)."""
        llguidance = _llg()
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    ascii_patterns(_json_schema(self.spec)), defaults=JSON_OPTIONS)
            except RecursionError:  # nested deeper than Python walks (json.loads was fine)
                raise InvalidArgumentError(FIELD, "the JSON schema is nested too deeply") from None
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(ascii_classes(self.spec))
        if self.kind == "choice":
            alts = " | ".join(json.dumps(c) for c in _choices(self.spec))
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alts}")
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(self.spec)  # GBNF (vLLM's EBNF form) or Lark as is
        except Exception as e:  # the converter raises its own parse errors
            raise InvalidArgumentError(FIELD, f"the grammar does not parse: {e}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)


_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_", "s": " \\t\\n\\r\\f\\v"}


def ascii_classes(rx: str) -> str:
    """`rx` with \\d, \\w and \\s as ASCII classes, as in JSON Schema's (ECMA-262) patterns and
    vLLM's regexes; the grammar engine's are Unicode (\\d would admit any script's digits)."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(rx):
        c = rx[i]
        if c == "\\" and i + 1 < len(rx):
            nxt = rx[i + 1]
            if nxt in _CLASSES:
                out.append(_CLASSES[nxt] if in_class else f"[{_CLASSES[nxt]}]")
            else:
                out.append(rx[i:i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class and out and out[-1] not in ("[", "[^"):
            in_class = False
        out.append(c)
        if c == "^" and in_class and out[-2:] == ["[", "^"]:
            out[-2:] = ["[^"]
        i += 1
    return "".join(out)


def ascii_patterns(schema):
    """The schema with every `pattern` keyword's classes made ASCII (see `ascii_classes`)."""
    if isinstance(schema, dict):
        return {k: (ascii_classes(v) if k == "pattern" and isinstance(v, str)
                    else ascii_patterns(v)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [ascii_patterns(v) for v in schema]
    return schema


def _json_schema(spec: str) -> dict:
    try:
        schema = json.loads(spec)
    except (ValueError, RecursionError) as e:
        raise InvalidArgumentError(FIELD, f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidArgumentError(FIELD, "the JSON schema must be an object")
    return schema


def _choices(spec: str) -> list[str]:
    try:
        choices = json.loads(spec)
    except ValueError as e:
        raise InvalidArgumentError(FIELD, f"the choices are not valid JSON: {e}") from None
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise InvalidArgumentError(FIELD, "the choices must be a non-empty array of "
                                   "non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise InvalidArgumentError(FIELD, f"at most {MAX_CHOICES} choices, got {len(choices)}")
    return choices


class Grammars:
    """One tokenizer's grammars: compiled once per constraint, cached (LRU, bounded), and a
    fresh matcher per request. Thread-safe."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int], *,
                 cache_size: int = 256) -> None:
        self.tokenizer = _llg().LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_ids))
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # constraints compiled (cache misses)

    def _prototype(self, so: StructuredOutput) -> llguidance.LLMatcher:
        key = (so.kind, so.spec)
        with self._lock:
            m = self._cache.get(key)
            if m is not None:
                self._cache.move_to_end(key)
                return m
        so.validate()
        try:  # the grammar's own text is built by llguidance, which refuses some JSON values
            m = _llg().LLMatcher(self.tokenizer, so.grammar(), log_level=0)
            error = m.get_error() if m.is_error() else None
        except (ValueError, TypeError, OverflowError) as e:
            error = str(e)
        if error is not None:
            raise InvalidArgumentError(FIELD, f"the {so.kind.replace('_', ' ')} cannot be "
                                       f"compiled: {_short(error)}")
        with self._lock:
            self.compiled += 1
            self._cache[key] = m
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return m

    def check(self, so: StructuredOutput) -> None:
        """Raises InvalidArgumentError naming the field if `so` cannot be compiled."""
        self._prototype(so)

    def matcher(self, so: StructuredOutput) -> llguidance.LLMatcher:
        """A matcher at the constraint's start, for one request."""
        return self._prototype(so).deep_copy()


def _short(message: str, limit: int = 300) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit] + "..."
