"""Tool calls in a model's output (the Hermes form), whole or as the text streams.

Owns reading `<tool_call> {"name": ..., "arguments": {...}} </tool_call>` blocks out of the
generated text: which blocks are calls, each call's name and its `arguments` (the model's own
JSON text of the object, exactly as written), and what is left as `content`. One incremental
scanner serves both forms: it walks each block's JSON once, tracking strings, escapes and depth
(a `</tool_call>` inside a JSON string does not end the block), so a chunk costs its own length.
- Whole (`parse`): a block is a call when its text is one JSON object with a string `name` and
  an object `arguments`; a block that is not stays in the content, as vLLM does (an unclosed
  last block counts when its JSON is whole). Content is the text outside calls, with whitespace
  that runs up to a call or ends the text dropped; null when nothing is left and there are calls.
- Streamed (`ToolCallStream`): content deltas until a block opens (text that may be the start
  of `<tool_call>` is held back), then per call a first delta with its index, id, type and name
  once the name is known, then `arguments` deltas as the object's text arrives; their
  concatenation is exactly the whole response's `arguments`. A block that breaks after its name
  was sent cannot be taken back: the rest of it is dropped (the whole response would keep the
  block as content).
With `max_calls` (parallel_tool_calls false) calls past the first are dropped, as vLLM does.
Pure: text in, OpenAI deltas out; no sockets, no tokenizer.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.router.openai_tools import TOOL_CALL_END as END
from pdserve.router.openai_tools import TOOL_CALL_START as START

_JSON_WS = " \t\n\r"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class _Block:
    """One block's JSON object, scanned as its text arrives. Positions index the whole output
    text; `start` is just past `<tool_call>`."""

    def __init__(self, start: int) -> None:
        self.start = self.i = start
        self.end: int | None = None  # where `</tool_call>` begins, once seen
        self.state = "pre"  # pre key colon value scalar after done bad
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.mark = 0  # where the current key or depth-1 value starts
        self.key: str | None = None
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None

    def scan(self, text: str) -> None:
        """Advance over `text` (the whole output so far) until it runs out, or the block ends."""
        n = len(text)
        while self.i < n and self.end is None:
            if self.state == "bad":
                at = text.find(END, self.i)
                if at >= 0:
                    self.end = at
                else:
                    self.i = max(self.i, n - len(END) + 1)
                return
            c = text[self.i]
            if self.in_str:
                self._in_string(c, text)
            elif c == "<":
                rest = text[self.i:self.i + len(END)]
                if rest == END:
                    self.end = self.i
                    return
                if END.startswith(rest):
                    return  # maybe the end tag: wait for more text
                self.state = "bad"
                continue
            elif self.depth >= 2:
                self._nested(c)
            else:
                self._top(c)
            self.i += 1

    def _in_string(self, c: str, text: str) -> None:
        if self.esc:
            self.esc = False
        elif c == "\\":
            self.esc = True
        elif c == '"':
            self.in_str = False
            if self.depth == 1 and self.state == "key":
                try:
                    self.key = json.loads(text[self.mark:self.i + 1])
                except ValueError:
                    self.state = "bad"
                    return
                self.state = "colon"
            elif self.depth == 1:
                self._value_done(text, self.i + 1)

    def _nested(self, c: str) -> None:
        if c == '"':
            self.in_str = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1:
                self._value_done(None, self.i + 1)

    def _top(self, c: str) -> None:
        s = self.state
        if s == "scalar":
            if c not in _JSON_WS + ",}":
                return
            self._value_done(None, self.i)
            s = self.state
        if c in _JSON_WS:
            return
        if s == "pre" and c == "{":
            self.depth, self.state = 1, "key"
        elif s == "key" and c == '"':
            self.in_str, self.mark = True, self.i
        elif s == "colon" and c == ":":
            self.state = "value"
        elif s == "value":
            self.mark = self.i
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth = 2
                if self.key == "arguments" and c == "{" and self.args_start is None:
                    self.args_start = self.i
            else:
                self.state = "scalar"
        elif s == "after" and c == ",":
            self.state = "key"
        elif s in ("key", "after") and c == "}":
            self.depth, self.state = 0, "done"
        else:
            self.state = "bad"

    def _value_done(self, text: str | None, end: int) -> None:
        self.state = "after"
        if self.key == "name" and self.name is None:
            if text is None or text[self.mark] != '"':
                self.state = "bad"  # a name that is not a string
                return
            try:
                self.name = json.loads(text[self.mark:end])
            except ValueError:
                self.state = "bad"
        elif self.key == "arguments" and self.args_end is None:
            if self.args_start != self.mark:
                self.state = "bad"  # arguments that are not an object
            else:
                self.args_end = end

    def call(self, text: str, end: int) -> tuple[str, str] | None:
        """(name, arguments) when the block's text (up to `end`) is one call, else None."""
        if self.name is None or self.args_end is None or self.state not in ("done", "after"):
            return None
        try:
            obj = json.loads(text[self.start:end], parse_constant=_no_constant)
        except (ValueError, RecursionError):
            return None
        args = text[self.args_start:self.args_end]
        if (not isinstance(obj, dict) or obj.get("name") != self.name
                or obj.get("arguments") != json.loads(args, parse_constant=_no_constant)):
            return None
        return self.name, args


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class ToolCallStream:
    """Tool calls out of text as it streams: `feed` each delta, `finish` at the end; both
    return OpenAI chat deltas (`{"content": ...}` or `{"tool_calls": [...]}`). With
    `eager=False` nothing is announced before its block has ended and proved a call (the
    whole-response reading: `parse`)."""

    def __init__(self, max_calls: int | None = None, *, eager: bool = True,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self.max_calls = max_calls
        self.eager = eager
        self.new_id = new_id
        self.text = ""
        self.pos = 0  # text before this is settled
        self.block: _Block | None = None
        self.announced = False  # the open block is a call the client was told of
        self.sent = 0  # arguments characters of the open call sent
        self.held = ""  # content whitespace, sent only if more content follows
        self.calls: list[Call] = []  # announced calls (their arguments as sent)
        self.content = ""  # content sent

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        return self._run(final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._run(final=True)

    # ---- the walk ------------------------------------------------------------------------
    def _run(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        text = self.text
        while True:
            if self.block is None:
                at = text.find(START, self.pos)
                if at < 0:
                    keep = 0 if final else _partial_tag(text, self.pos)
                    self._content(text[self.pos:len(text) - keep], out)
                    self.pos = len(text) - keep
                    break
                self._content(text[self.pos:at], out)
                self.block, self.announced, self.sent = _Block(at + len(START)), False, 0
                self.pos = at
                continue
            b = self.block
            b.scan(text)
            if self.eager and not self.announced and b.name is not None and self._room():
                self._announce(b.name, out)
            if self.announced:
                self._send_arguments(text, out)
            if b.end is None and not final:
                break
            self._close(text, b.end if b.end is not None else len(text), out)
            if b.end is None:
                break
        if final:
            if not self.calls:
                self._content_out(self.held, out)
            self.held = ""
        if self.block is None and self.pos:
            self.text, self.pos = self.text[self.pos:], 0  # what is settled is not kept
        return out

    def _room(self) -> bool:
        return self.max_calls is None or len(self.calls) < self.max_calls

    def _close(self, text: str, end: int, out: list[dict[str, Any]]) -> None:
        """The open block ends at `end` (where its end tag starts, or the text's end)."""
        b = self.block
        assert b is not None
        stop = min(end + len(END), len(text))
        found = b.call(text, end)
        if self.announced:
            self._send_arguments(text, out)
        elif found is not None and self._room():
            self._announce(found[0], out)
            self._send_arguments(text, out)
        elif found is None:
            self._content(text[self.pos:stop], out)  # not a call: it stays text
        else:
            self.held = ""  # a call past max_calls: dropped, as the whitespace before it
        self.block, self.pos = None, stop

    def _announce(self, name: str, out: list[dict[str, Any]]) -> None:
        self.held = ""  # whitespace up to a call is dropped
        call = Call(self.new_id(), name, "")
        self.calls.append(call)
        self.announced = True
        out.append({"tool_calls": [{"index": len(self.calls) - 1, "id": call.id,
                                    "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})

    def _send_arguments(self, text: str, out: list[dict[str, Any]]) -> None:
        b = self.block
        assert b is not None
        if b.args_start is None or b.state == "bad" and b.args_end is None:
            return
        upto = b.args_end if b.args_end is not None else b.i
        more = text[b.args_start + self.sent:upto]
        if not more:
            return
        self.sent += len(more)
        k = len(self.calls) - 1
        last = self.calls[k]
        self.calls[k] = Call(last.id, last.name, last.arguments + more)
        out.append({"tool_calls": [{"index": k, "function": {"arguments": more}}]})

    def _content(self, s: str, out: list[dict[str, Any]]) -> None:
        if not s:
            return
        s = self.held + s
        kept = s.rstrip()
        self.held = s[len(kept):]
        self._content_out(kept, out)

    def _content_out(self, s: str, out: list[dict[str, Any]]) -> None:
        if s:
            self.content += s
            out.append({"content": s})


def _partial_tag(text: str, pos: int) -> int:
    """How many characters at the end of `text[pos:]` may be the start of `<tool_call>`."""
    for k in range(min(len(START) - 1, len(text) - pos), 0, -1):
        if text.endswith(START[:k]):
            return k
    return 0


@dataclass(frozen=True)
class Parsed:
    content: str | None
    calls: tuple[Call, ...]


def parse(text: str, max_calls: int | None = None,
          new_id: Callable[[], str] = new_call_id) -> Parsed:
    """The whole output's calls and content (see the module doc)."""
    s = ToolCallStream(max_calls, eager=False, new_id=new_id)
    s.feed(text)
    s.finish()
    if not s.calls:
        return Parsed(text, ())
    return Parsed(s.content or None, tuple(s.calls))
