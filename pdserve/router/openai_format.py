"""`pdserve.v1.GenerateResponse` messages in, OpenAI response bodies and stream chunks out.

Owns the JSON shapes of `/v1/chat/completions` and `/v1/completions` (whole responses and SSE
chunks, usage, both logprobs formats, and a chat's `tool_calls`, with finish_reason
"tool_calls", when the request offered tools: read from the text by `tool_output`). Pure: no
sockets, no asyncio; token ids become text through the `token_text` callable it is given.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Iterable
from typing import Any

from pdserve.core import finish as fin
from pdserve.proto import api_pb2, common_pb2
from pdserve.router.openai_schema import ApiRequest
from pdserve.router.tool_output import ToolCallStream, parse

FINISH = {common_pb2.FINISH_REASON_STOP: fin.STOP, common_pb2.FINISH_REASON_LENGTH: fin.LENGTH,
          common_pb2.FINISH_REASON_ABORT: fin.ABORT}
# JSON has no -inf; vLLM reports an impossible token's logprob as -9999.0 too.
MIN_LOGPROB = -9999.0
TOOL_CALLS = "tool_calls"  # OpenAI's finish_reason when the model called tools


def token_texts(tokenizer, cache_size: int = 1 << 16) -> Callable[[int], str]:
    """id -> the token's text as a client sees it (special tokens included), memoised."""
    @functools.lru_cache(maxsize=cache_size)
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    return text


def _lp(x: float) -> float:
    return x if math.isfinite(x) and x > MIN_LOGPROB else MIN_LOGPROB


def usage_of(u: api_pb2.Usage) -> dict[str, Any]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {_json(obj)}\n\n"


class Renderer:
    """One request's response: chunks as gRPC messages arrive, or the whole body at the end."""

    def __init__(self, req: ApiRequest, request_id: str, model: str, created: int,
                 token_text: Callable[[int], str], echo: str = "") -> None:
        self.req = req
        self.id = request_id
        self.model = model
        self.created = created
        self.token_text = token_text
        self._offset: dict[int, int] = {}  # completions' text_offset runs across chunks, per choice
        self.chat = req.kind == "chat"
        self._finished: dict[int, api_pb2.Usage] = {}  # choice index -> its usage
        self.echo = echo  # completions with echo: the prompt's text, before each choice's
        self._echo_lps = bool(echo) and req.prompt_logprobs is not None  # ... with logprobs
        use = req.tool_use
        # A chat that may call tools: its output is read for calls, per choice.
        self.tools = use if self.chat and use is not None and use.parses else None
        self._calls: dict[int, ToolCallStream] = {}

    @property
    def done(self) -> bool:
        """Every choice has ended."""
        return len(self._finished) >= self.req.n

    def complete(self, responses: list[api_pb2.GenerateResponse]) -> bool:
        """Whether `responses` end every choice."""
        return len({r.index for r in responses if r.finish_reason}) >= self.req.n

    def usage(self, finals: Iterable[api_pb2.Usage]) -> dict[str, Any]:
        """One usage for all choices: the prompt once, every choice's completion tokens."""
        finals = list(finals)
        total = api_pb2.Usage()
        total.CopyFrom(finals[0])
        total.completion_tokens = sum(u.completion_tokens for u in finals)
        return usage_of(total)

    # ---- logprobs ---------------------------------------------------------------------------
    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        t = self.token_text(token_id)
        return {"token": t, "logprob": _lp(logprob), "bytes": list(t.encode("utf-8"))}

    def logprobs(self, lps: Iterable[common_pb2.TokenLogprobs], index: int = 0,
                 first: api_pb2.GenerateResponse | None = None) -> dict[str, Any] | None:
        """A choice's logprobs in the API's format; completions with echo: the prompt's
        first (from the choice's `first` message), its first token's logprob null."""
        if self.req.logprobs is None:
            return None
        lps = list(lps)
        if self.chat:
            return {"content": [{**self._entry(lp.token_id, lp.logprob),
                                 "top_logprobs": [self._entry(t.token_id, t.logprob)
                                                  for t in lp.top]} for lp in lps]}
        tokens, values, tops, offsets = [], [], [], []
        if first is not None and self.req.prompt_logprobs is not None and first.prompt_token_ids:
            t = self.token_text(first.prompt_token_ids[0])
            tokens, values, tops, offsets = [t], [None], [None], [0]
            self._offset[index] = len(t)
            lps = [*first.prompt_logprobs, *lps]
        for lp in lps:
            t = self.token_text(lp.token_id)
            tokens.append(t)
            values.append(_lp(lp.logprob))
            # As OpenAI's legacy format and vLLM: the top k, plus the sampled token if not in them.
            top = {self.token_text(x.token_id): _lp(x.logprob) for x in lp.top}
            top.setdefault(t, _lp(lp.logprob))
            tops.append(top)
            offsets.append(self._offset.get(index, 0))
            self._offset[index] = offsets[-1] + len(t)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    # ---- streaming --------------------------------------------------------------------------
    def frames(self, r: api_pb2.GenerateResponse) -> str:
        """The SSE frames of one gRPC message (`chunks`, each as `sse` writes it). A plain text
        delta, by far the most frequent, is written from the request's own template: only the
        text is encoded, to the same bytes."""
        if (r.text and not r.finish_reason and self.tools is None and self.req.logprobs is None
                and not (self._echo_lps and r.prompt_token_ids)):
            head, tail = self._delta_template()
            return f"{head}{r.index},{self._text_key}{_json(r.text)}{tail}"
        return "".join(sse(c) for c in self.chunks(r))

    @functools.cached_property
    def _text_key(self) -> str:
        return '"delta":{"content":' if self.chat else '"text":'

    def _delta_template(self) -> tuple[str, str]:
        """(head, tail) of a text delta's frame around its choice index and text."""
        template = self.__dict__.get("_template")
        if template is None:
            marker = "\u0000"  # a choice index and a text no chunk holds
            body: dict[str, Any] = ({"delta": {"content": marker}} if self.chat
                                    else {"text": marker})
            whole = sse(self._chunk([{"index": -7, **body, "logprobs": None,
                                      "finish_reason": None}]))
            # The id and model are JSON strings: no quote of theirs is left unescaped.
            head, rest = whole.split('"index":-7,', 1)
            head += '"index":'
            tail = rest.split(_json(marker), 1)[1]
            template = self.__dict__["_template"] = (head, tail)
        return template

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if self.req.include_usage:
            out["usage"] = None
        return out

    def first_chunks(self) -> list[dict[str, Any]]:
        if not self.chat:  # with prompt logprobs, the echo comes with them (`chunks`)
            return [self._chunk([{"index": i, "text": self.echo, "logprobs": None,
                                  "finish_reason": None}])
                    for i in range(self.req.n)] if self.echo and not self._echo_lps else []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
                for i in range(self.req.n)]

    def chunks(self, r: api_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """The SSE chunks for one gRPC message (a choice's last one also carries its finish;
        the usage follows the last choice's)."""
        out = []
        i = r.index
        if self._echo_lps and r.prompt_token_ids:  # the choice's first message
            out.append(self._chunk([{"index": i, "text": self.echo, "logprobs": self.logprobs(
                (), i, r), "finish_reason": None}]))
        if self.tools is not None:
            out += self._tool_chunks(r)
        elif r.text or (r.token_ids and self.req.logprobs is not None):
            lps = self.logprobs(r.logprobs, i)
            if self.chat:
                choice = {"index": i, "delta": {"content": r.text}, "logprobs": lps,
                          "finish_reason": None}
            else:
                choice = {"index": i, "text": r.text, "logprobs": lps, "finish_reason": None}
            out.append(self._chunk([choice]))
        if r.finish_reason:
            finish = FINISH.get(r.finish_reason, fin.STOP)
            if finish == fin.STOP and i in self._calls and self._calls[i].called:
                finish = TOOL_CALLS
            if self.chat:
                choice = {"index": i, "delta": {}, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": i, "text": "", "logprobs": None, "finish_reason": finish}
            out.append(self._chunk([choice]))
            self._finished[i] = r.usage
            if self.req.include_usage and self.done:
                out.append({**self._chunk([]), "usage": self.usage(
                    self._finished[k] for k in sorted(self._finished))})
        return out

    def _tool_chunks(self, r: api_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """A choice's text as `tool_output` reads it: content deltas (held back while they
        may open a call), then each call's name and arguments; logprobs ride on the first."""
        calls = self._calls.get(r.index)
        if calls is None:
            assert self.tools is not None
            calls = self._calls[r.index] = ToolCallStream(self.tools.max_calls)
        deltas = calls.feed(r.text)
        if r.finish_reason:
            deltas += calls.finish()
        lps = self.logprobs(r.logprobs, r.index) if r.token_ids else None
        if lps is not None and not deltas:
            deltas = [{}]
        return [self._chunk([{"index": r.index, "delta": d, "logprobs": lps if k == 0 else None,
                              "finish_reason": None}]) for k, d in enumerate(deltas)]

    # ---- whole response ---------------------------------------------------------------------
    def full(self, responses: list[api_pb2.GenerateResponse]) -> dict[str, Any]:
        by_index: dict[int, list[api_pb2.GenerateResponse]] = {}
        for r in responses:
            by_index.setdefault(r.index, []).append(r)
        choices = []
        for i in sorted(by_index):
            rs = by_index[i]
            text = "".join(r.text for r in rs)
            lps = self.logprobs((lp for r in rs for lp in r.logprobs), i, rs[0])
            finish = FINISH.get(rs[-1].finish_reason, fin.STOP)
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if self.tools is not None:
                    found = parse(text, self.tools.max_calls)
                    message["content"] = found.content
                    if found.calls:
                        message["tool_calls"] = [c.openai() for c in found.calls]
                        finish = TOOL_CALLS if finish == fin.STOP else finish
                choices.append({"index": i, "message": message, "logprobs": lps,
                                "finish_reason": finish})
            else:
                choices.append({"index": i, "text": self.echo + text, "logprobs": lps,
                                "finish_reason": finish})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": self.usage(by_index[i][-1].usage for i in sorted(by_index))}
