"""A decode stream's reader that fell behind the engine sends what queued up as one message:
every token once, in order, logprobs parallel to them, the finish reason on the last one, and
an error only after the tokens that came before it."""

from __future__ import annotations

import pytest

from pdserve.worker.decode.role import _coalesce
from pdserve.engine.engine import StepOutput
from pdserve.engine.sampling import TokenLogprobs
from pdserve.worker.engine_loop import RequestStream, StreamItem


def _out(tokens, finished=False, reason=None, logprobs=False):
    lp = [TokenLogprobs(t, -0.5) for t in tokens] if logprobs else None
    return StreamItem(output=StepOutput("r", list(tokens), finished, reason, 4, 0, logprobs=lp))


def _stream(*items) -> RequestStream:
    s = RequestStream()
    for it in items:
        s.q.put(it)
    return s


def test_queued_steps_go_out_as_one_chunk_and_the_rest_stays_for_later():
    s = _stream(_out([2]), _out([3, 4]))
    chunk, finished, pending = _coalesce(_out([1]), s)
    assert (chunk.token_ids, chunk.finish_reason, finished, pending) == ([1, 2, 3, 4], None,
                                                                        False, None)
    assert s.q.empty()


def test_the_finish_ends_the_chunk_with_its_reason_and_logprobs_stay_parallel():
    s = _stream(_out([2], logprobs=True), _out([3], True, "length", logprobs=True))
    chunk, finished, _ = _coalesce(_out([1], logprobs=True), s)
    assert finished and chunk.finish_reason == "length" and chunk.token_ids == [1, 2, 3]
    assert [lp.token_id for lp in chunk.logprobs] == [1, 2, 3]


def test_logprobs_are_none_when_a_step_has_none():
    chunk, _, _ = _coalesce(_out([1], logprobs=True), _stream(_out([2])))
    assert chunk.token_ids == [1, 2] and chunk.logprobs is None


def test_an_error_behind_tokens_waits_for_them_and_alone_raises():
    err = StreamItem(error=RuntimeError("step failed"))
    chunk, finished, pending = _coalesce(_out([1]), _stream(err))
    assert chunk.token_ids == [1] and not finished and pending is err
    with pytest.raises(RuntimeError, match="step failed"):
        _coalesce(err, _stream())
