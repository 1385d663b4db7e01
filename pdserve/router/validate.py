"""Request validation and tokenization at the front door: bad input gets an error naming the field.

Pure: a request message and the tokenizer in, token ids and sampling parameters out, or an
`InvalidArgumentError` whose `field` is the request field at fault (invariant 7).
"""

from __future__ import annotations

from pdserve.engine.config import ModelConfig
from pdserve.engine.sampling import InvalidArgumentError, SamplingParams
from pdserve.engine.tokenizer import ChatTemplateError
from pdserve.proto import api_pb2
from pdserve.wire import params_from_proto

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def check_model(requested: str, served: tuple[str, ...]) -> None:
    if requested and requested not in served:
        raise InvalidArgumentError("model", f"unknown model {requested!r}; this server serves "
                                   f"{', '.join(served)}")


def prompt_ids_of(request: api_pb2.GenerateRequest, tokenizer, vocab_size: int) -> list[int]:
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidArgumentError("prompt", "one of prompt, chat or token_ids is required")
    if which == "prompt":
        if not request.prompt:
            raise InvalidArgumentError("prompt", "must not be empty")
        ids = tokenizer.encode(request.prompt)
    elif which == "chat":
        msgs = request.chat.messages
        if not msgs:
            raise InvalidArgumentError("chat.messages", "must not be empty")
        for i, m in enumerate(msgs):
            if m.role not in CHAT_ROLES:
                raise InvalidArgumentError(f"chat.messages[{i}].role",
                                           f"must be one of {', '.join(CHAT_ROLES)}")
        try:
            text = tokenizer.apply_chat_template([{"role": m.role, "content": m.content}
                                                  for m in msgs])
        except ChatTemplateError as e:
            raise InvalidArgumentError("chat.messages", str(e)) from None
        ids = tokenizer.encode(text, add_special_tokens=False)
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
                model: ModelConfig) -> SamplingParams:
    if prompt_len >= max_model_len:
        raise InvalidArgumentError("prompt", f"{prompt_len} tokens does not fit the context "
                                   f"length {max_model_len}")
    params = params_from_proto(request.sampling)
    params.validate(max_model_len=max_model_len, prompt_len=prompt_len,
                    vocab_size=model.vocab_size)
    return params.with_seed()
