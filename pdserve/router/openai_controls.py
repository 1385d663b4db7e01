"""OpenAI request fields that shape sampling beyond plain numbers: logit bias and structured
outputs (`response_format`, and vLLM's `guided_*` fields).

Owns their JSON shapes and which request field a later error names: a structured
output that cannot be compiled is reported against the field it came from. The constraint
itself is checked by the gRPC service (`pdserve.core.structured`). Pure.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pdserve.core.sampling_params import MAX_LOGIT_BIAS
from pdserve.core.structured import StructuredOutput

# vLLM's extra fields, one constraint each; at most one of them (or response_format) is sent.
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def controls(body: dict, bad, kind) -> dict[str, Any]:
    """`logit_bias` and the structured output of an OpenAI body, as `ApiRequest` fields, plus
    `params` entries (gRPC field -> request field). `bad(param, message, code)` makes the 400;
    `kind(v)` names a JSON value's type. (The numeric controls are plain numbers: `_common`.)"""
    out: dict[str, Any] = {}
    params: dict[str, str] = {}
    out["logit_bias"] = _logit_bias(body.get("logit_bias"), bad, kind)
    params["logit_bias"] = "logit_bias"
    so, source = _structured(body, bad, kind)
    out["structured_output"] = so
    if source:
        params["structured_output"] = source
    out["params"] = params
    return out


def _logit_bias(v: Any, bad, kind) -> tuple[tuple[int, float], ...]:
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise bad("logit_bias", f"must be an object mapping token ids to biases, got {kind(v)}",
                  "invalid_type")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(v)}")
    out = []
    for key, b in v.items():
        try:
            t = int(key)
        except ValueError:
            raise bad("logit_bias", f"keys must be token ids, got {key!r}") from None
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise bad(f"logit_bias.{key}", f"must be a number, got {kind(b)}", "invalid_type")
        if not math.isfinite(b) or not -100 <= b <= 100:
            raise bad(f"logit_bias.{key}", f"must be in [-100, 100], got {b}")
        if not 0 <= t < 2**31:
            raise bad("logit_bias", f"token id {t} is out of range")
        out.append((t, float(b)))
    return tuple(sorted(out))


def _structured(body: dict, bad, kind) -> tuple[StructuredOutput | None, str | None]:
    sent = [name for name in ("response_format", *_GUIDED) if body.get(name) is not None]
    rf = body.get("response_format")
    if rf is not None and isinstance(rf, dict) and rf.get("type") == "text":
        sent.remove("response_format")
    if len(sent) > 1:
        raise bad(sent[1], f"only one structured output may be asked for; got "
                  f"{' and '.join(sent)}")
    if not sent:
        return None, None
    name = sent[0]
    if name == "response_format":
        return _response_format(rf, bad, kind)
    v = body[name]
    k = _GUIDED[name]
    if k == "json_schema":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise bad(name, f"is not valid JSON: {e}") from None
        if not isinstance(v, dict):
            raise bad(name, f"must be a JSON schema object, got {kind(v)}", "invalid_type")
        return StructuredOutput(k, json.dumps(v)), name
    if k == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise bad(name, "must be a non-empty array of non-empty strings", "invalid_type")
        return StructuredOutput(k, json.dumps(v)), name
    if not isinstance(v, str) or not v:
        raise bad(name, f"must be a non-empty string, got {kind(v)}", "invalid_type")
    try:  # JSON may carry lone surrogates ("\ud800"); no grammar or protobuf string takes them
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(name, "must be valid Unicode text (no lone surrogates)") from None
    return StructuredOutput(k, v), name


def _response_format(rf: Any, bad, kind) -> tuple[StructuredOutput, str]:
    if not isinstance(rf, dict):
        raise bad("response_format", f"must be an object, got {kind(rf)}", "invalid_type")
    t = rf.get("type")
    if t == "json_object":
        return StructuredOutput("json_object"), "response_format"
    if t != "json_schema":
        raise bad("response_format.type", "must be one of text, json_object, json_schema")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise bad("response_format.json_schema", "is required for type json_schema and must "
                  "be an object", "invalid_type")
    name = js.get("name")
    if not isinstance(name, str) or not name:
        raise bad("response_format.json_schema.name", "is required (a non-empty string)")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad("response_format.json_schema.strict", f"must be a boolean, got "
                  f"{kind(strict)}", "invalid_type")
    schema = js.get("schema")
    if schema is None:
        return StructuredOutput("json_object"), "response_format.json_schema"
    if not isinstance(schema, dict):
        raise bad("response_format.json_schema.schema", f"must be an object, got "
                  f"{kind(schema)}", "invalid_type")
    if strict:
        where = strict_violation(schema)
        if where is not None:
            raise bad("response_format.json_schema.schema", f"strict mode: {where}")
    return (StructuredOutput("json_schema", json.dumps(schema)),
            "response_format.json_schema.schema")


def strict_violation(schema: Any, path: str = "#") -> str | None:
    """Where `schema` breaks OpenAI's strict-mode rules (every object lists all its properties
    as required and sets additionalProperties to false), or None. Strict mode promises the
    output has exactly the schema's shape; these rules are what make that promise checkable."""
    if isinstance(schema, list):
        for i, s in enumerate(schema):
            found = strict_violation(s, f"{path}/{i}")
            if found:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    props = schema.get("properties")
    if schema.get("type") == "object" or isinstance(props, dict):
        if schema.get("additionalProperties") is not False:
            return f"{path}: additionalProperties must be false"
        if isinstance(props, dict) and set(schema.get("required") or ()) != set(props):
            return f"{path}: every property must be required"
    for key, sub in schema.items():
        if key in ("properties", "$defs", "definitions") and isinstance(sub, dict):
            for k, s in sub.items():
                found = strict_violation(s, f"{path}/{key}/{k}")
                if found:
                    return found
        elif key in ("items", "anyOf", "allOf", "oneOf", "prefixItems") or key == "not":
            found = strict_violation(sub, f"{path}/{key}")
            if found:
                return found
    return None
