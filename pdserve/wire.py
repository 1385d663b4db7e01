"""Conversions between `pdserve.v1` messages and engine types, shared by every service.

Owns only the mapping (and the proto defaults' meaning); validation stays in
`SamplingParams.validate` so gRPC, HTTP and in-process callers get the same errors.
"""

from __future__ import annotations

from pdserve.core import finish
from pdserve.core.roles import ACTIVE, DECODE, DRAINING, FAILED, GONE, PREFILL
from pdserve.core.sampling_params import SamplingParams, TokenLogprobs
from pdserve.core.structured import StructuredOutput
from pdserve.proto import common_pb2, router_pb2, worker_pb2

DEFAULT_MAX_TOKENS = 16  # as vLLM's completions API when the client sets none

_FINISH = {
    finish.STOP: common_pb2.FINISH_REASON_STOP,
    finish.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    finish.ABORT: common_pb2.FINISH_REASON_ABORT,
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
}
_FINISH_BACK = {v: k for k, v in _FINISH.items()}
# A worker's role on the wire; ROLE_UNSPECIFIED is no role (None).
ROLE_OF_PROTO = {worker_pb2.ROLE_PREFILL: PREFILL, worker_pb2.ROLE_DECODE: DECODE}
PROTO_OF_ROLE = {v: k for k, v in ROLE_OF_PROTO.items()}
# A member's state in a router's membership on the wire.
STATE_OF_PROTO = {router_pb2.MEMBER_STATE_ACTIVE: ACTIVE,
                  router_pb2.MEMBER_STATE_DRAINING: DRAINING,
                  router_pb2.MEMBER_STATE_GONE: GONE, router_pb2.MEMBER_STATE_FAILED: FAILED}
PROTO_OF_STATE = {v: k for k, v in STATE_OF_PROTO.items()}


def params_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=p.temperature if p.HasField("temperature") else 0.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens if p.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        min_p=p.min_p,
        min_tokens=p.min_tokens,
        structured_output=(StructuredOutput(p.structured_output.kind, p.structured_output.spec)
                           if p.HasField("structured_output") else None),
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
    )


def params_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=p.max_tokens,
        stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos)
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    msg.presence_penalty = p.presence_penalty
    msg.frequency_penalty = p.frequency_penalty
    if p.repetition_penalty != 1.0:
        msg.repetition_penalty = p.repetition_penalty
    msg.logit_bias.update(dict(p.logit_bias))
    msg.min_p = p.min_p
    msg.min_tokens = p.min_tokens
    if p.structured_output is not None:
        msg.structured_output.kind = p.structured_output.kind
        msg.structured_output.spec = p.structured_output.spec
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    return msg


def logprobs_to_proto(lp: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[common_pb2.Logprob(token_id=t, logprob=v) for t, v in lp.top])


def finish_to_proto(reason: str | None) -> int:
    return _FINISH[reason]


def finish_from_proto(value: int) -> str | None:
    return _FINISH_BACK[value]


def role_from_proto(value: int) -> str | None:
    """`PREFILL`, `DECODE`, or None for ROLE_UNSPECIFIED or a value this version does not
    know."""
    return ROLE_OF_PROTO.get(value)


def role_to_proto(role: str | None) -> worker_pb2.Role:
    """The wire value of `PREFILL` or `DECODE`; None is ROLE_UNSPECIFIED."""
    return worker_pb2.ROLE_UNSPECIFIED if role is None else PROTO_OF_ROLE[role]
