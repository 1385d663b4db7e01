"""What a request must satisfy before the engine takes it: errors naming the field.

Owns the checks of a new request (prompt ids, context length, sampling parameters, KV blocks
it will need) and of a resumed one (the tokens it already emitted elsewhere). Must not touch
the scheduler, the block pool or the model: it reads sizes, not state.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from pdserve.core.sampling_params import InvalidArgumentError, SamplingParams


def check_request(prompt_ids: Sequence[int], params: SamplingParams, *, vocab_size: int,
                  max_model_len: int, block_size: int, num_blocks: int) -> None:
    if not prompt_ids:
        raise InvalidArgumentError("prompt", "must not be empty")
    if any((not isinstance(t, int)) or t < 0 or t >= vocab_size for t in prompt_ids):
        raise InvalidArgumentError("prompt", f"token ids must be in [0, {vocab_size})")
    if len(prompt_ids) >= max_model_len:
        raise InvalidArgumentError(
            "prompt", f"{len(prompt_ids)} tokens does not fit the context length "
            f"{max_model_len}")
    params.validate(max_model_len=max_model_len, prompt_len=len(prompt_ids),
                    vocab_size=vocab_size)
    need = -(-(len(prompt_ids) + params.max_tokens) // block_size)
    if need > num_blocks:
        raise InvalidArgumentError(
            "max_tokens", f"the request needs {need} KV blocks; this worker has {num_blocks}")


def check_resume(resume: Sequence[int], params: SamplingParams, prefill_only: bool, *,
                 vocab_size: int, eos_ids: Collection[int]) -> None:
    """A resumed request must be one that was still running: room left in max_tokens and
    no token that would have ended it (else its output would differ from the
    uninterrupted one). Called after `check_request`."""
    if prefill_only:
        raise InvalidArgumentError("resume_token_ids", "a prefill-only request emits one "
                                   "token; there is nothing to resume")
    if any((not isinstance(t, int)) or t < 0 or t >= vocab_size for t in resume):
        raise InvalidArgumentError("resume_token_ids",
                                   f"token ids must be in [0, {vocab_size})")
    # Fewer than max_tokens: then the prompt plus them leave room in the context too
    # (`check_request` checked prompt + max_tokens against it).
    if len(resume) >= params.max_tokens:
        raise InvalidArgumentError(
            "resume_token_ids", f"{len(resume)} tokens already reach max_tokens "
            f"{params.max_tokens}: the request had finished")
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    for i, t in enumerate(resume):
        if t in stops:
            raise InvalidArgumentError(
                "resume_token_ids", f"token {t} at {i} is a stop token: the request had "
                f"finished")
