"""OpenAI tool calling, the request side: `tools`, `tool_choice`, `parallel_tool_calls` and the
tool fields of chat turns (an assistant's `tool_calls`, a tool turn's `tool_call_id`), validated;
and the grammar that makes a `required` or named `tool_choice` hold.

Owns the rules of those fields (JSON types, function names as OpenAI allows them, a named
choice naming a function that is in `tools`, arguments that are JSON objects, a tool turn
answering a call made earlier in the conversation) and the error each breach gets, naming the
field (`tools[0].function.name`, `messages[2].tool_call_id`). Errors are made by the caller's
`bad(param, message, code)`, so the HTTP API (a 400) and the gRPC path (INVALID_ARGUMENT) share
these rules. The grammar forces the Hermes form the output parser reads (`tool_output`):
`<tool_call>`, a newline, `{"name": <an allowed name>, "arguments": <an object>}`, a newline,
`</tool_call>`; one block, or several for `required` with parallel calls, the arguments
matching the function's JSON schema (llguidance's Lark with `%json`).
Pure: no tokenizer, no sockets; must not render prompts (`tool_prompt`) or parse output.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from pdserve.core.structured import JSON_OPTIONS, StructuredOutput, ascii_patterns
from pdserve.router.openai_controls import strict_violation

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128  # as OpenAI
# Schemas and arguments nest at most this deep: templates and grammars walk them recursively.
MAX_DEPTH = 64
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# A function that declares no parameters takes none: its arguments are `{}`.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}

Bad = Callable[..., Exception]  # bad(param, message, code="invalid_value") -> the error to raise


def kind_of(v: Any) -> str:
    """A JSON value's type, as error messages name it."""
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(v), "null")


@dataclass(frozen=True)
class Function:
    """One entry of `tools`; `parameters` is its JSON schema as JSON text ("" when absent)."""

    name: str
    description: str | None = None
    parameters: str = ""
    strict: bool | None = None

    def openai(self) -> dict[str, Any]:
        """The tool in OpenAI's shape, as chat templates take `tools`."""
        f: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            f["description"] = self.description
        if self.parameters:
            f["parameters"] = json.loads(self.parameters)
        if self.strict is not None:
            f["strict"] = self.strict
        return {"type": "function", "function": f}


@dataclass(frozen=True)
class ToolUse:
    """What a request says about tools: the functions, `tool_choice` ("none", "auto",
    "required", or "named" with `named` the function), and whether calls may be parallel."""

    tools: tuple[Function, ...]
    choice: str = "auto"
    named: str = ""
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the output is read for tool calls ("none" renders the tools, reads none)."""
        return self.choice != "none"

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1

    def tools_json(self) -> str:
        return json.dumps([f.openai() for f in self.tools], ensure_ascii=False)


@dataclass(frozen=True)
class ToolCall:
    """A call in an assistant turn of the conversation; `arguments` is a JSON object as text."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


# ---- request fields --------------------------------------------------------------------------

def tool_use(body: dict, bad: Bad, kind: Callable[[Any], str]) -> ToolUse | None:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls`; None when it has no
    tools (an empty list is none, as in vLLM), in which case `tool_choice` may only be "none"."""
    raw = body.get("tools")
    funcs = () if raw is None or raw == [] else functions(raw, "tools", bad, kind)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"must be a boolean, got {kind(parallel)}",
                  "invalid_type")
    choice = body.get("tool_choice")
    if not funcs:
        if choice not in (None, "none"):
            raise bad("tool_choice", "needs tools: send the functions in `tools`")
        return None
    if choice is None or isinstance(choice, str):
        if choice is not None and choice not in CHOICES:
            raise bad("tool_choice", f"must be one of {', '.join(CHOICES)} or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        return ToolUse(funcs, choice or "auto", "", parallel is not False)
    if not isinstance(choice, dict):
        raise bad("tool_choice", f"must be a string or an object, got {kind(choice)}",
                  "invalid_type")
    if choice.get("type") != "function":
        raise bad("tool_choice.type", "must be \"function\"")
    f = choice.get("function")
    if not isinstance(f, dict):
        raise bad("tool_choice.function", "must be an object with the function's name",
                  "invalid_type")
    name = f.get("name")
    if not isinstance(name, str):
        raise bad("tool_choice.function.name", f"must be a string, got {kind(name)}",
                  "invalid_type")
    if name not in {t.name for t in funcs}:
        raise bad("tool_choice.function.name", f"names no function in tools: {name[:80]!r}")
    return ToolUse(funcs, "named", name, parallel is not False)


def functions(v: Any, where: str, bad: Bad, kind: Callable[[Any], str]
              ) -> tuple[Function, ...]:
    """`tools` (OpenAI's shape) as `Function`s; `where` names the field in errors."""
    if not isinstance(v, list):
        raise bad(where, f"must be an array of tools, got {kind(v)}", "invalid_type")
    if len(v) > MAX_TOOLS:
        raise bad(where, f"at most {MAX_TOOLS} tools, got {len(v)}")
    out: list[Function] = []
    for i, t in enumerate(v):
        at = f"{where}[{i}]"
        if not isinstance(t, dict):
            raise bad(at, f"must be an object, got {kind(t)}", "invalid_type")
        if t.get("type") != "function":
            raise bad(f"{at}.type", "must be \"function\" (the only tool type served)")
        f = t.get("function")
        if not isinstance(f, dict):
            raise bad(f"{at}.function", f"must be an object, got {kind(f)}", "invalid_type")
        name = f.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise bad(f"{at}.function.name", "must be 1 to 64 letters, digits, underscores or "
                      "dashes")
        if any(o.name == name for o in out):
            raise bad(f"{at}.function.name", f"{name!r} names an earlier tool too")
        desc = f.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad(f"{at}.function.description", f"must be a string, got {kind(desc)}",
                      "invalid_type")
        strict = f.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad(f"{at}.function.strict", f"must be a boolean, got {kind(strict)}",
                      "invalid_type")
        check_json(f, f"{at}.function", bad)
        params = f.get("parameters")
        if params is not None:
            _parameters(params, f"{at}.function.parameters", bool(strict), bad, kind)
        out.append(Function(name, desc, "" if params is None else json.dumps(params), strict))
    return tuple(out)


def _parameters(p: Any, where: str, strict: bool, bad: Bad, kind) -> None:
    if not isinstance(p, dict):
        raise bad(where, f"must be a JSON schema object, got {kind(p)}", "invalid_type")
    if p.get("type", "object") != "object":
        raise bad(where, f"must describe an object (type \"object\"), got type "
                  f"{json.dumps(p.get('type'))}")
    if strict:
        found = strict_violation(p)
        if found is not None:
            raise bad(where, f"strict mode: {found}")


def check_json(v: Any, where: str, bad: Bad) -> None:
    """`v` nests at most MAX_DEPTH deep, holds no NaN or infinity (Python's JSON reads them;
    JSON has none), and every string in it (keys too) is valid Unicode: no lone surrogates,
    which JSON may carry but no tokenizer or protobuf string takes."""
    stack = [(v, 0)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, (dict, list)) and depth >= MAX_DEPTH:
            raise bad(where, f"nests deeper than {MAX_DEPTH} levels")
        if isinstance(x, dict):
            stack.extend((k, depth) for k in x)
            stack.extend((y, depth + 1) for y in x.values())
        elif isinstance(x, list):
            stack.extend((y, depth + 1) for y in x)
        elif isinstance(x, float) and not math.isfinite(x):
            raise bad(where, "must be JSON, which has no NaN or Infinity")
        elif isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise bad(where, "must be valid Unicode text (no lone surrogates)") from None


def tool_calls(v: Any, where: str, bad: Bad, kind: Callable[[Any], str]
               ) -> tuple[ToolCall, ...]:
    """An assistant turn's `tool_calls` (OpenAI's shape: arguments are JSON text)."""
    if not isinstance(v, list):
        raise bad(where, f"must be an array of tool calls, got {kind(v)}", "invalid_type")
    out: list[ToolCall] = []
    for j, c in enumerate(v):
        at = f"{where}[{j}]"
        if not isinstance(c, dict):
            raise bad(at, f"must be an object, got {kind(c)}", "invalid_type")
        cid = c.get("id")
        if not isinstance(cid, str) or not cid:
            raise bad(f"{at}.id", "is required (a non-empty string)")
        if any(o.id == cid for o in out):
            raise bad(f"{at}.id", f"{cid[:80]!r} names an earlier call of this turn too")
        if c.get("type", "function") != "function":
            raise bad(f"{at}.type", "must be \"function\"")
        f = c.get("function")
        if not isinstance(f, dict):
            raise bad(f"{at}.function", f"must be an object, got {kind(f)}", "invalid_type")
        name = f.get("name")
        if not isinstance(name, str) or not name:
            raise bad(f"{at}.function.name", "is required (a non-empty string)")
        args = f.get("arguments")
        if not isinstance(args, str):
            raise bad(f"{at}.function.arguments", f"must be a string of JSON, got "
                      f"{kind(args)}", "invalid_type")
        try:
            parsed = json.loads(args)
        except (ValueError, RecursionError):
            parsed = None
        if not isinstance(parsed, dict):
            raise bad(f"{at}.function.arguments", "must be a JSON object, as text")
        check_json(c, at, bad)
        check_json(parsed, f"{at}.function.arguments", bad)
        out.append(ToolCall(cid, name, args))
    return tuple(out)


def tool_turn_name(call_id: str, earlier: dict[str, str], where: str, bad: Bad) -> str:
    """The function a tool turn answers (by its `tool_call_id`), from the calls made earlier."""
    if call_id not in earlier:
        raise bad(f"{where}.tool_call_id", f"{call_id[:80]!r} answers no tool call of an "
                  "earlier assistant turn")
    return earlier[call_id]


# ---- the grammar for required and named tool_choice ------------------------------------------

def tool_grammar(use: ToolUse, tag_tokens: bool = False) -> StructuredOutput | None:
    """The structured output that makes `use.choice` hold: None for "auto" and "none"; for
    "required" and "named", a Lark grammar that admits only `<tool_call>` blocks of the allowed
    functions, arguments per their schemas. `tag_tokens`: the tokenizer has `<tool_call>` and
    `</tool_call>` as tokens of their own (as Qwen2's), which the grammar then names as tokens,
    so that the model writes them as it was trained to."""
    if use.choice not in ("required", "named"):
        return None
    funcs = [f for f in use.tools if use.choice == "required" or f.name == use.named]
    if tag_tokens:
        start, end = TOOL_CALL_START, TOOL_CALL_END
    else:
        start, end = json.dumps(TOOL_CALL_START), json.dumps(TOOL_CALL_END)
    many = use.choice == "required" and use.parallel
    lines = ["%llguidance {}",
             "start: call" + (' ("\\n" call)*' if many else ""),
             f'call: {start} "\\n" fn "\\n" {end}',
             "fn: " + " | ".join(f"fn_{i}" for i in range(len(funcs)))]
    for i, f in enumerate(funcs):
        # A Lark string is written as a JSON string is (the name is [A-Za-z0-9_-]).
        head = json.dumps('{"name": ' + json.dumps(f.name) + ', "arguments": ')
        lines.append(f'fn_{i}: {head} args_{i} "}}"')
        lines.append(f"args_{i}: %json {json.dumps(_arguments_schema(f))}")
    return StructuredOutput("grammar", "\n".join(lines) + "\n")


def _arguments_schema(f: Function) -> dict[str, Any]:
    schema = json.loads(f.parameters) if f.parameters else dict(NO_PARAMETERS)
    schema = ascii_patterns(schema)
    schema.setdefault("type", "object")  # arguments are an object, whatever else it says
    own = schema.get("x-guidance")
    schema["x-guidance"] = {**JSON_OPTIONS, **(own if isinstance(own, dict) else {})}
    return schema
