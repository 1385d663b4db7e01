"""A chat with tools as the model's prompt: the gRPC `ChatInput` (turns, their tool calls and
tool results, the `tools` JSON) in, token ids out, through the model's chat template.

Owns the turns as chat templates take them (transformers' convention: an assistant's
`tool_calls` as `[{"id", "type": "function", "function": {"name", "arguments": <object>}}]`, a
tool turn with `tool_call_id` and `name`, and `tools=` beside the messages), which templates
render natively when they know tools (their source mentions `tools`, as Qwen2's Hermes-style
templates do), and pdserve's own rendering for templates that do not (plain ChatML, as the
default model's): the functions and how to call them in a system turn (merged into the first
one when the chat has one), earlier calls as `<tool_call>` blocks in the assistant's text, and
tool results as `<tool_response>` blocks in a user turn. That rendering puts everything in
message content, which `encode_chat` keeps as text even where it spells a control token; a
template that renders tools natively sees strings outside content, so there a string spelling
one of the tokenizer's special tokens is refused, naming the field.
A chat without tools renders exactly as before (same messages, same template call).
Pure: a tokenizer in, ids out; errors are `InvalidArgumentError` naming the gRPC field.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from pdserve.core.errors import InvalidArgumentError
from pdserve.proto import api_pb2
from pdserve.router.openai_tools import (TOOL_CALL_END, TOOL_CALL_START, functions, kind_of,
                                         tool_calls)

_KNOWS_TOOLS = re.compile(r"\btools\b")


def _bad(param: str | None, message: str, code: str = "") -> InvalidArgumentError:
    return InvalidArgumentError(param or "chat", message)


def chat_ids(chat: api_pb2.ChatInput, tokenizer) -> list[int]:
    """The ids of `chat` rendered with the tokenizer's chat template (see the module doc)."""
    tools = _tools(chat.tools_json)
    msgs = [_turn(m, i) for i, m in enumerate(chat.messages)]
    if knows_tools(tokenizer.chat_template):
        if not tokenizer.allow_special_tokens_in_messages:
            _no_spelled_specials(chat, tokenizer)
        return tokenizer.encode_chat(msgs, tools=tools)
    return tokenizer.encode_chat(default_rendering(msgs, tools))


def knows_tools(template: str | None) -> bool:
    """Whether a chat template renders tools itself (its source uses `tools`)."""
    return bool(template) and _KNOWS_TOOLS.search(template) is not None


@functools.lru_cache(maxsize=8)
def has_tool_call_tokens(tokenizer) -> bool:
    """Whether `<tool_call>` and `</tool_call>` are tokens of their own (added tokens, as in
    Qwen2's vocabulary), which a grammar then names as tokens."""
    added = {t.content for t in tokenizer.backend.get_added_tokens_decoder().values()}
    return TOOL_CALL_START in added and TOOL_CALL_END in added


def _tools(text: str) -> list[dict[str, Any]] | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InvalidArgumentError("chat.tools_json", f"is not valid JSON: {e}") from None
    return [f.openai() for f in functions(value, "chat.tools_json", _bad, kind_of)] or None


def _turn(m: api_pb2.ChatMessage, i: int) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls_json:
        where = f"chat.messages[{i}].tool_calls_json"
        if m.role != "assistant":
            raise InvalidArgumentError(where, "only assistant turns make tool calls")
        try:
            value = json.loads(m.tool_calls_json)
        except (ValueError, RecursionError) as e:
            raise InvalidArgumentError(where, f"is not valid JSON: {e}") from None
        d["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                           for c in tool_calls(value, where, _bad, kind_of)]
    if m.role == "tool":
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
    return d


# ---- pdserve's rendering, for templates without tools ---------------------------------------

def default_rendering(msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                      ) -> list[dict[str, Any]]:
    """`msgs` as plain role/content turns: the tools in a system turn, calls and results as
    `<tool_call>` and `<tool_response>` blocks. Turns without tools come back as they are."""
    if not tools and not any("tool_calls" in m or m["role"] == "tool" for m in msgs):
        return msgs
    out: list[dict[str, Any]] = []
    rest = msgs
    if tools:
        guide = tools_guide(tools)
        if msgs and msgs[0]["role"] == "system":
            first = msgs[0]["content"]
            out.append({"role": "system", "content": f"{first}\n\n{guide}" if first else guide})
            rest = msgs[1:]
        else:
            out.append({"role": "system", "content": guide})
    results_open = False  # the last turn out is a user turn of tool results
    for m in rest:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if results_open:
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block})
            results_open = True
            continue
        results_open = False
        if "tool_calls" in m:
            calls = "\n".join(call_block(c["function"]["name"], c["function"]["arguments"])
                              for c in m["tool_calls"])
            text = m["content"]
            m = {"role": m["role"], "content": (text if not text or text.endswith("\n")
                                                 else text + "\n") + calls}
        out.append(m)
    return out


def call_block(name: str, arguments: Any) -> str:
    """One call as the model is asked to write it (and as the tool grammar forces it)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"


def tools_guide(tools: list[dict[str, Any]]) -> str:
    """The system text that offers `tools` to a model whose template has no tool support."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    example = call_block("function_name", {"parameter": "value"})
    return ("# Functions\n\n"
            "You may answer in text, or call one or more of the functions below to get "
            "information or to act for the user. Each function is described by a JSON object "
            "between <tools> and </tools>:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "To call a function, write a <tool_call> block holding a JSON object with the "
            "function's \"name\" and its \"arguments\" (an object that follows the function's "
            "parameters), one block per call:\n"
            f"{example}\n"
            "Each result comes back to you between <tool_response> and </tool_response>.")


# ---- strings a native template renders outside message content ---------------------------

@functools.lru_cache(maxsize=8)
def _specials(tokenizer) -> re.Pattern | None:
    texts = sorted((t.content for t in tokenizer.backend.get_added_tokens_decoder().values()
                    if t.special and t.content), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def _no_spelled_specials(chat: api_pb2.ChatInput, tokenizer) -> None:
    found = _specials(tokenizer)
    if found is None:
        return
    fields = [("chat.tools_json", chat.tools_json)]
    for i, m in enumerate(chat.messages):
        fields += [(f"chat.messages[{i}].tool_calls_json", m.tool_calls_json),
                   (f"chat.messages[{i}].tool_call_id", m.tool_call_id),
                   (f"chat.messages[{i}].name", m.name)]
    for name, text in fields:
        # JSON text: a token spelled with escapes (\u003c...) decodes to the same string.
        plain = text if not name.endswith("_json") or not text else \
            json.dumps(json.loads(text), ensure_ascii=False)
        hit = found.search(plain)
        if hit:
            raise InvalidArgumentError(name, f"spells the control token {hit.group(0)!r}, "
                                       "which this model's template would render as one")
