"""Request validation and tokenization at the front door: bad input gets an error naming the field.

Pure: a request message and the tokenizer in, token ids and sampling parameters out, or an
`InvalidArgumentError` whose `field` is the request field at fault (invariant 7). Sizes are
checked first (`limits`): a request too large to ever fit is refused before it is tokenized or
rendered, so refusing it costs about as much as reading it. Chat messages are encoded with the
tokenizer's `encode_chat` (text spelling a control token stays text unless the router allows it);
a chat with tools or tool turns is rendered by `tool_prompt`.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.engine.config import ModelConfig
from pdserve.core.sampling_params import InvalidArgumentError, SamplingParams
from pdserve.core.structured import Grammars
from pdserve.engine.tokenizer import ChatTemplateError
from pdserve.proto import api_pb2
from pdserve.router import limits
from pdserve.router.tool_prompt import chat_ids
from pdserve.wire import params_from_proto

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def check_model(requested: str, served: tuple[str, ...]) -> None:
    if requested and requested not in served:
        raise InvalidArgumentError("model", f"unknown model {limits.quoted(requested)}; this "
                                   f"server serves {', '.join(served)}")


def check_sizes(request: api_pb2.GenerateRequest, max_model_len: int,
                max_token_bytes: int) -> None:
    """Every bound a request can be held to from its sizes alone, without tokenizing it."""
    rid = request.request_id
    if len(rid) > limits.MAX_REQUEST_ID_CHARS or not rid.isprintable():
        raise InvalidArgumentError("request_id", f"must be at most {limits.MAX_REQUEST_ID_CHARS}"
                                   f" printable characters, got {limits.quoted(rid)}")
    if len(request.cache_salt.encode("utf-8")) > limits.MAX_CACHE_SALT_BYTES:
        raise InvalidArgumentError("cache_salt", f"must be at most {limits.MAX_CACHE_SALT_BYTES} "
                                   f"bytes, got {len(request.cache_salt.encode('utf-8'))}")
    s = request.sampling
    if len(s.stop) > limits.MAX_STOP_STRINGS:
        raise InvalidArgumentError("stop", f"at most {limits.MAX_STOP_STRINGS} stop strings, got "
                                   f"{len(s.stop)}")
    for i, stop in enumerate(s.stop):
        if len(stop.encode("utf-8")) > limits.MAX_STOP_STRING_BYTES:
            raise InvalidArgumentError(f"stop[{i}]", f"must be at most "
                                       f"{limits.MAX_STOP_STRING_BYTES} bytes, got "
                                       f"{len(stop.encode('utf-8'))}")
    if len(s.stop_token_ids) > limits.MAX_STOP_TOKEN_IDS:
        raise InvalidArgumentError("stop_token_ids", f"at most {limits.MAX_STOP_TOKEN_IDS} ids, "
                                   f"got {len(s.stop_token_ids)}")
    which = request.WhichOneof("input")
    most = limits.max_prompt_bytes(max_model_len, max_token_bytes)
    fits = (f"cannot fit the context length {max_model_len} (at most {most} bytes: "
            f"{max_token_bytes} bytes per token at most)")
    if which == "prompt":
        n = len(request.prompt.encode("utf-8"))
        if n > most:
            raise InvalidArgumentError("prompt", f"{n} bytes of text {fits}")
        n += len(request.suffix.encode("utf-8"))
        if n > most:
            raise InvalidArgumentError("suffix", f"{n} bytes of prompt and suffix {fits}")
    elif which == "chat":
        msgs = request.chat.messages
        # Every turn renders to at least one token (its role marker) in a chat template.
        if len(msgs) >= max_model_len:
            raise InvalidArgumentError("chat.messages", f"{len(msgs)} messages cannot fit the "
                                       f"context length {max_model_len}")
        n = sum(len(m.content.encode("utf-8")) + len(m.tool_calls_json.encode("utf-8"))
                for m in msgs) + len(request.chat.tools_json.encode("utf-8"))
        if n > most:
            raise InvalidArgumentError("chat.messages", f"{n} bytes of content and tools {fits}")
    elif which == "token_ids" and len(request.token_ids.ids) >= max_model_len:
        # As a prompt found too long once tokenized: the prompt, whatever form it came in.
        raise InvalidArgumentError("prompt", f"{len(request.token_ids.ids)} tokens does not "
                                   f"fit the context length {max_model_len}")


# The fill-in-the-middle control tokens, as the code models' tokenizers spell them.
FIM_SPELLINGS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
                 ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))


def fill_in_the_middle(tokenizer, prefix: str, suffix: str) -> list[int]:
    """The prompt that asks a model for the text between `prefix` and `suffix`, in the
    prefix-suffix-middle order the code models are trained on; INVALID_ARGUMENT naming
    `suffix` when the tokenizer has no such tokens."""
    for spelling in FIM_SPELLINGS:
        ids = [tokenizer.token_to_id(t) for t in spelling]
        if None not in ids:
            pre, suf, mid = ids
            return ([pre] + tokenizer.encode(prefix, add_special_tokens=False) + [suf]
                    + tokenizer.encode(suffix, add_special_tokens=False) + [mid])
    raise InvalidArgumentError("suffix", "this model has no fill-in-the-middle tokens "
                               f"({', '.join(FIM_SPELLINGS[0])} or "
                               f"{', '.join(FIM_SPELLINGS[1])})")


def prompt_ids_of(request: api_pb2.GenerateRequest, tokenizer, vocab_size: int,
                  max_model_len: int | None = None) -> list[int]:
    """The prompt's token ids. With `max_model_len`, `check_sizes` runs first."""
    if max_model_len is not None:
        check_sizes(request, max_model_len, tokenizer.max_token_bytes)
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidArgumentError("prompt", "one of prompt, chat or token_ids is required")
    if request.suffix and which != "prompt":
        raise InvalidArgumentError("suffix", "needs a text prompt")
    if which == "prompt":
        if not request.prompt:
            raise InvalidArgumentError("prompt", "must not be empty")
        ids = (fill_in_the_middle(tokenizer, request.prompt, request.suffix) if request.suffix
               else tokenizer.encode(request.prompt))
    elif which == "chat":
        msgs = request.chat.messages
        if not msgs:
            raise InvalidArgumentError("chat.messages", "must not be empty")
        for i, m in enumerate(msgs):
            if m.role not in CHAT_ROLES:
                raise InvalidArgumentError(f"chat.messages[{i}].role",
                                           f"must be one of {', '.join(CHAT_ROLES)}")
        try:
            if request.chat.tools_json or any(m.tool_calls_json or m.role == "tool"
                                              for m in msgs):
                ids = chat_ids(request.chat, tokenizer)
            else:
                ids = tokenizer.encode_chat([{"role": m.role, "content": m.content}
                                             for m in msgs])
        except ChatTemplateError as e:  # the template's own words, which may quote a message
            raise InvalidArgumentError("chat.messages", limits.cut(str(e))) from None
    else:
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidArgumentError("token_ids", "must not be empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgumentError("token_ids", f"ids must be in [0, {vocab_size}); got {bad[0]}")
    if not ids:
        raise InvalidArgumentError("prompt", "tokenizes to no tokens")
    return ids


def sampling_of(request: api_pb2.GenerateRequest, prompt_len: int, max_model_len: int,
                model: ModelConfig, grammars: Callable[[], Grammars] | None = None
                ) -> SamplingParams:
    """The request's validated sampling, with a concrete seed. `grammars` (the router's,
    built on first use) compiles a structured output here, so that one that cannot be compiled
    is refused before any worker sees it."""
    if prompt_len >= max_model_len:
        raise InvalidArgumentError("prompt", f"{prompt_len} tokens does not fit the context "
                                   f"length {max_model_len}")
    params = params_from_proto(request.sampling)
    params.validate(max_model_len=max_model_len, prompt_len=prompt_len,
                    vocab_size=model.vocab_size)
    if params.structured_output is not None and grammars is not None:
        grammars().check(params.structured_output)
    return params.with_seed()
