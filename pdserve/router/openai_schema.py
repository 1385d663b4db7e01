"""OpenAI request bodies in, a validated `ApiRequest` out; gRPC statuses back to OpenAI errors.

Owns the HTTP API's input rules: which fields `/v1/chat/completions` and `/v1/completions`
accept, their JSON types and ranges, and the error a client sees (`OpenAIError`: status code plus
OpenAI's `{"error": {message, type, param, code}}` with `param` naming the field at fault).
List and string sizes are bounded as on the gRPC path (`limits`: stop strings, stop token ids,
cache salt). Validation the gRPC path already does (context length, prompt size, tokenization)
is not repeated here; `error_from_status` maps those errors back to the HTTP field names.
Pure: no sockets, no asyncio, no gRPC imports.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.core.sampling_params import MAX_LOGPROBS
from pdserve.core.structured import StructuredOutput
from pdserve.router.choices import MAX_CHOICES
from pdserve.router.openai_controls import controls
from pdserve.router.openai_tools import (ToolCall, ToolUse, tool_calls, tool_turn_name,
                                         tool_use)
from pdserve.router.limits import (MAX_CACHE_SALT_BYTES, MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS,
                                   MAX_STOP_TOKEN_IDS)

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_RETRY = re.compile(r"retry after (\d+(?:\.\d+)?)\s*s")
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when neither request nor model names one


class OpenAIError(Exception):
    """An error answered in OpenAI's shape; `param` names the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message,
                          "type": ("rate_limit_error" if self.status == 429 else
                                   "invalid_request_error" if self.status < 500 else
                                   "server_error"),
                          "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str = "invalid_value") -> OpenAIError:
    """A 400; the message starts with the field, as the gRPC API's errors do."""
    return OpenAIError(400, f"{param}: {message}" if param else message, param, code)


@dataclass(frozen=True)
class ChatTurn:
    """One chat message: its role and text, an assistant's tool calls, and for a tool turn the
    call it answers (`tool_call_id`) and that call's function (`name`)."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""


@dataclass(frozen=True)
class ApiRequest:
    """A validated OpenAI request, in the terms of `pdserve.v1.GenerateRequest`."""

    kind: str  # "chat" or "completion"
    model: str | None
    messages: tuple[ChatTurn, ...] = ()  # chat
    prompt: str | None = None  # completion: text ...
    prompt_ids: tuple[int, ...] | None = None  # ... or token ids
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # None: not sent (0 and -1 sent mean off, as in vLLM)
    seed: int | None = None
    max_tokens: int | None = None  # None: the API's default (see openai_api)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives per token; None: no logprobs
    stream: bool = False
    include_usage: bool = False
    cache_salt: str = ""  # vLLM's extension: requests share cached prefixes only within a salt
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_output: StructuredOutput | None = None
    tool_use: ToolUse | None = None  # chat: the functions offered, and how they may be called
    n: int = 1  # choices
    echo: bool = False  # completions: the prompt's text before the completion's
    suffix: str = ""  # completions: fill in the middle, before this text
    best_of: int | None = None  # None: n
    prompt_logprobs: int | None = None  # completions with echo and logprobs: the prompt's too
    # gRPC field -> the request field it came from, for errors the gRPC path reports.
    params: dict[str, str] = field(default_factory=dict)


def with_defaults(req: ApiRequest, defaults: Mapping[str, float | int]) -> ApiRequest:
    """`req` with the sampling settings it left unset filled in: the model's recommended
    `temperature`, `top_p`, `top_k` (`defaults`, as vLLM applies a model's generation config),
    else OpenAI's (temperature 1.0, top_p 1, top_k off). Settings the request sent win."""
    t = req.temperature if req.temperature is not None else defaults.get("temperature")
    p = req.top_p if req.top_p is not None else defaults.get("top_p")
    k = req.top_k if req.top_k is not None else defaults.get("top_k", 0)
    return replace(req, temperature=DEFAULT_TEMPERATURE if t is None else t, top_p=p, top_k=k)


# ---- JSON type checks (bool is not a number here, as in OpenAI's API) ----------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad(name, f"must be an integer, got {_kind(v)}", "invalid_type")
    if not lo <= v <= hi:
        raise bad(name, f"must be in [{lo}, {hi}], got {v}")
    return v


def _number(body: dict, name: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not (_is_int(v) or isinstance(v, float)):
        raise bad(name, f"must be a number, got {_kind(v)}", "invalid_type")
    v = float(v)
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        raise bad(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return v


def _bool(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad(name, f"must be a boolean, got {_kind(v)}", "invalid_type")
    return v


def _str(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise bad(name, f"must be a string, got {_kind(v)}", "invalid_type")
    return v if v is None else _utf8(v, name)


def _utf8(v: str, name: str) -> str:
    # JSON may carry lone surrogates ("\\ud800"); no tokenizer or protobuf string takes them.
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(name, "must be valid Unicode text (no lone surrogates)") from None
    return v


def _kind(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(v), "null")


def _token_ids(v: Any, name: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise bad(name, "must be an array of integers", "invalid_type")
    if any(not 0 <= t <= INT32_MAX for t in v):
        raise bad(name, f"token ids must be in [0, {INT32_MAX}]")
    return tuple(v)


# ---- fields shared by both endpoints -------------------------------------------------------------

# Fields pdserve does not implement: accepted only at their no-op value, else a 400 naming them.
_UNSUPPORTED = {"functions": (None, []),  # the legacy API; `tools` replaces it
                "prompt_logprobs": (None,)}  # vLLM's own; completions take echo + logprobs
# The chat API has no echo or suffix (as OpenAI's): accepted only at their no-op value there.
_COMPLETIONS_ONLY = {"echo": (None, False), "suffix": (None, "")}
# The completions API has no tools (as OpenAI's): accepted only at their no-op value there.
_CHAT_ONLY = {"tools": (None, [])}


def _common(body: dict, unsupported: Mapping[str, tuple] = _UNSUPPORTED) -> dict[str, Any]:
    for name, allowed in unsupported.items():
        v = body.get(name)
        if not any(type(v) is type(a) and v == a for a in allowed):
            raise bad(name, f"is not supported by this server (allowed: "
                      f"{', '.join(json.dumps(a) for a in allowed)})", "unsupported_value")
    out: dict[str, Any] = {"model": _str(body, "model")}
    out["n"] = _int(body, "n", 1, MAX_CHOICES) or 1
    best_of = _int(body, "best_of", 1, MAX_CHOICES)
    if best_of is not None and best_of < out["n"]:
        raise bad("best_of", f"must be >= n ({out['n']}), got {best_of}")
    if best_of is not None and best_of > out["n"] and body.get("stream"):
        raise bad("best_of", "cannot be streamed: the best choices are known only at the end")
    out["best_of"] = best_of
    out["temperature"] = _number(body, "temperature", 0.0, 2.0)
    out["top_p"] = _number(body, "top_p", 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", -1, INT32_MAX)  # vLLM's extension; -1 and 0 mean off
    out["top_k"] = None if top_k is None else max(top_k, 0)
    out["seed"] = _int(body, "seed", INT64_MIN, INT64_MAX)
    out["ignore_eos"] = bool(_bool(body, "ignore_eos"))
    params = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
              "stop": "stop", "stop_token_ids": "stop_token_ids", "cache_salt": "cache_salt",
              "n": "n", "best_of": "best_of"}
    # max_completion_tokens replaces max_tokens in OpenAI's chat API; as vLLM, it wins.
    mt = _int(body, "max_tokens", 1, INT32_MAX)
    mct = _int(body, "max_completion_tokens", 1, INT32_MAX)
    out["max_tokens"] = mct if mct is not None else mt
    params["max_tokens"] = "max_completion_tokens" if mct is not None else "max_tokens"
    out["stop"] = _stop(body.get("stop"))
    sti = body.get("stop_token_ids")
    out["stop_token_ids"] = () if sti is None else _token_ids(sti, "stop_token_ids")
    if len(out["stop_token_ids"]) > MAX_STOP_TOKEN_IDS:
        raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got "
                  f"{len(out['stop_token_ids'])}")
    out["stream"] = bool(_bool(body, "stream"))
    out["include_usage"] = _stream_options(body.get("stream_options"), out["stream"])
    _str(body, "user")  # accepted and ignored, as a label for abuse monitoring
    out["cache_salt"] = _str(body, "cache_salt") or ""
    if len(out["cache_salt"].encode("utf-8")) > MAX_CACHE_SALT_BYTES:
        raise bad("cache_salt", f"must be at most {MAX_CACHE_SALT_BYTES} bytes")
    for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                         ("min_p", 0.0, 1.0)):
        out[name] = _number(body, name, lo, hi)
    out["repetition_penalty"] = _number(body, "repetition_penalty", 0.0, 2.0, lo_open=True)
    out["min_tokens"] = _int(body, "min_tokens", 0, INT32_MAX)
    params.update((name, name) for name in ("presence_penalty", "frequency_penalty", "min_p",
                                            "repetition_penalty", "min_tokens"))
    ctl = controls(body, bad, _kind)
    params.update(ctl.pop("params"))
    out.update(ctl)
    out["params"] = params
    return out


def _stop(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", "must be a string or an array of strings", "invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if any(not s for s in stops):
        raise bad("stop", "stop strings must be non-empty")
    stops = [_utf8(s, "stop") for s in stops]
    for i, s in enumerate(stops):
        if len(s.encode("utf-8")) > MAX_STOP_STRING_BYTES:
            raise bad(f"stop[{i}]" if isinstance(v, list) else "stop",
                      f"must be at most {MAX_STOP_STRING_BYTES} bytes, got "
                      f"{len(s.encode('utf-8'))}")
    return tuple(stops)


def _stream_options(v: Any, stream: bool) -> bool:
    if v is None:
        return False
    if not isinstance(v, dict):
        raise bad("stream_options", f"must be an object, got {_kind(v)}", "invalid_type")
    if not stream:
        raise bad("stream_options", "is only allowed when stream is true")
    usage = v.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise bad("stream_options.include_usage", f"must be a boolean, got {_kind(usage)}",
                  "invalid_type")
    return bool(usage)


# ---- the two endpoints ---------------------------------------------------------------------------

def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {_kind(body)}",
                  "invalid_type")
    return body


def parse_chat(body: Any) -> ApiRequest:
    body = _object(body)
    common = _common(body, {**_UNSUPPORTED, **_COMPLETIONS_ONLY})
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages", "is required", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty array of messages")
    calls: dict[str, str] = {}  # id -> function, of the calls made so far in the chat
    messages = tuple(_message(m, i, calls) for i, m in enumerate(msgs))
    want = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise bad("top_logprobs", "requires logprobs to be true")
    params = {**common.pop("params"), "prompt": "messages", "chat.messages": "messages",
              "logprobs": "top_logprobs" if top is not None else "logprobs",
              "chat.tools_json": "tools"}
    tools = tool_use(body, bad, _kind)
    if tools is not None and tools.choice in ("required", "named"):
        # The tool grammar (openai_api) is the request's structured output.
        if common["structured_output"] is not None:
            raise bad("tool_choice", f"a required or named tool choice cannot be combined "
                      f"with {params.get('structured_output', 'a structured output')}")
        params["structured_output"] = "tools"
    return ApiRequest(kind="chat", messages=messages, logprobs=(top or 0) if want else None,
                      tool_use=tools, params=params, **common)


def _message(m: Any, i: int, calls: dict[str, str]) -> ChatTurn:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(where, f"must be an object, got {_kind(m)}", "invalid_type")
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise bad(f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text is served
        texts = []
        for j, part in enumerate(content):
            if (not isinstance(part, dict) or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)):
                raise bad(f"{where}.content[{j}]", "only {\"type\": \"text\", \"text\": ...} "
                          "parts are supported")
            texts.append(_utf8(part["text"], f"{where}.content[{j}].text"))
        content = "".join(texts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise bad(f"{where}.content", f"must be a string or an array of text parts, got "
                  f"{_kind(content)}", "invalid_type")
    content = _utf8(content, f"{where}.content")
    made: tuple[ToolCall, ...] = ()
    if m.get("tool_calls") is not None:
        if role != "assistant":
            raise bad(f"{where}.tool_calls", "only assistant turns make tool calls")
        made = tool_calls(m["tool_calls"], f"{where}.tool_calls", bad, _kind)
        calls.update((c.id, c.name) for c in made)
    if role != "tool":
        return ChatTurn(role, content, made)
    call_id = m.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"{where}.tool_call_id", "is required for a tool turn: the id of the call "
                  "it answers")
    _utf8(call_id, f"{where}.tool_call_id")
    return ChatTurn(role, content, (), call_id, tool_turn_name(call_id, calls, where, bad))


def parse_completion(body: Any) -> ApiRequest:
    body = _object(body)
    common = _common(body, {**_UNSUPPORTED, **_CHAT_ONLY})
    prompt, ids = _prompt(body.get("prompt"))
    k = _int(body, "logprobs", 0, MAX_LOGPROBS)
    echo = bool(_bool(body, "echo"))
    suffix = _str(body, "suffix") or ""
    if suffix and ids is not None:
        raise bad("suffix", "needs a text prompt")
    params = {**common.pop("params"), "prompt": "prompt", "token_ids": "prompt",
              "logprobs": "logprobs", "suffix": "suffix"}
    return ApiRequest(kind="completion", prompt=prompt, prompt_ids=ids, logprobs=k,
                      echo=echo, suffix=suffix, params=params,
                      prompt_logprobs=k if echo else None, **common)


def _prompt(v: Any) -> tuple[str | None, tuple[int, ...] | None]:
    if v is None:
        raise bad("prompt", "is required", "missing_required_parameter")
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one
    if isinstance(v, str):
        if not v:
            raise bad("prompt", "must not be empty")
        return _utf8(v, "prompt"), None
    if isinstance(v, list) and v and all(_is_int(t) for t in v):
        return None, _token_ids(v, "prompt")
    raise bad("prompt", "must be a non-empty string or array of token ids (batches of more "
              "than one prompt are not supported)")


# ---- gRPC status -> OpenAI error -----------------------------------------------------------------

_HTTP_STATUS = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403,
                "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503,
                "DEADLINE_EXCEEDED": 504}
_STATUS_CODE = {401: "invalid_api_key", 403: "permission_denied", 429: "rate_limit_exceeded",
                503: "service_unavailable", 504: "timeout", 500: "internal_error"}


def error_from_status(code: str, details: str, req: ApiRequest,
                      retry_after: str | None = None) -> OpenAIError:
    """An OpenAI error for a gRPC status `code` (its name, e.g. "INVALID_ARGUMENT").

    The router's errors name the gRPC field first ("max_tokens: ...", possibly after the hop,
    "prefill: max_tokens: ..."); that field is mapped back to the request field it came from.
    A 429's Retry-After (whole seconds, at least 1) comes from the `retry-after` trailer when
    the router sent one, else from the message's "retry after Ns", else 1.
    """
    status = _HTTP_STATUS.get(code, 500)
    if status == 400:
        param, message = _split_field(details, req.params)
        if param == "model":
            return model_not_found(req.model or "")
        return bad(param, message)
    headers = {}
    if status == 429:
        m = _RETRY.search(f"retry after {retry_after}s" if retry_after else details)
        try:
            seconds = float(m.group(1)) if m else 1.0
        except ValueError:
            seconds = 1.0
        headers["Retry-After"] = str(max(1, math.ceil(min(seconds, 3600.0))))
    return OpenAIError(status, details or code, None, _STATUS_CODE.get(status), headers)


def _split_field(details: str, params: dict[str, str]) -> tuple[str | None, str]:
    rest = details
    for _ in range(3):  # at most "prefill: max_tokens: message"
        head, sep, tail = rest.partition(": ")
        if not sep:
            break
        if head == "model":
            return "model", tail
        name = _rename(head, params)
        if name is not None:
            return name, tail
        rest = tail
    return None, details


def _rename(head: str, params: dict[str, str]) -> str | None:
    """The request field for a gRPC field name, keeping an index ("chat.messages[2].role")."""
    if head in params:
        return params[head]
    for grpc_name, http_name in params.items():
        if head.startswith((grpc_name + "[", grpc_name + ".")):
            # chat.messages[2].tool_calls_json: the turn's tool_calls, sent as JSON text
            return (http_name + head[len(grpc_name):]).replace(".tool_calls_json", ".tool_calls")
    return None


def model_not_found(model: str) -> OpenAIError:
    # As OpenAI (and vLLM): 404 with code model_not_found; param names the field too.
    return OpenAIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
