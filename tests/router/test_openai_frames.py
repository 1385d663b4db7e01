"""A streamed response's SSE frames: the text deltas written from the request's own template
are the bytes the generic chunk encoding gives (OpenAI clients parse them as JSON), whatever
the text, the model name, the choice or the request's options."""

from __future__ import annotations

import json

import pytest

from pdserve.proto import api_pb2, common_pb2
from pdserve.router.openai_format import Renderer, sse
from pdserve.router.openai_schema import parse_chat, parse_completion

TEXTS = ["Hello", ' a "quoted" word', "line\nbreak\ttab \\ slash", "é 中文 🙂", "\x00\x1f\x7f",
         "</script>", "-7,"]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("model", ["m", 'odd "model", -7, é'])
def test_a_text_deltas_frame_is_the_generic_encodings_bytes(kind, usage, model):
    body = {"stream": True, "n": 2, "stream_options": {"include_usage": usage}}
    req = (parse_chat({**body, "messages": [{"role": "user", "content": "hi"}]}) if kind == "chat"
           else parse_completion({**body, "prompt": "hi"}))
    fast = Renderer(req, "chatcmpl-1f", model, 1765000000, str)
    generic = Renderer(req, "chatcmpl-1f", model, 1765000000, str)
    for index in (0, 1):
        for text in TEXTS:
            r = api_pb2.GenerateResponse(text=text, index=index, token_ids=[5])
            frame = fast.frames(r)
            assert frame == "".join(sse(c) for c in generic.chunks(r))
            sent = json.loads(frame.removeprefix("data: "))
            got = (sent["choices"][0]["delta"]["content"] if kind == "chat"
                   else sent["choices"][0]["text"])
            assert got == text and sent["model"] == model and sent["choices"][0]["index"] == index


def test_a_last_message_and_logprobs_take_the_generic_encoding():
    req = parse_chat({"stream": True, "logprobs": True,
                      "messages": [{"role": "user", "content": "hi"}]})
    r = api_pb2.GenerateResponse(text="x", token_ids=[5], logprobs=[common_pb2.TokenLogprobs(
        token_id=5, logprob=-0.5)])
    fast, generic = (Renderer(req, "c", "m", 0, str) for _ in range(2))
    assert fast.frames(r) == "".join(sse(c) for c in generic.chunks(r))
    assert '"logprobs":{' in fast.frames(r)
    last = api_pb2.GenerateResponse(text="y", token_ids=[6], finish_reason=2,
                                    usage=api_pb2.Usage(prompt_tokens=1, completion_tokens=2))
    fast, generic = (Renderer(req, "c", "m", 0, str) for _ in range(2))
    frames = fast.frames(last)
    assert frames == "".join(sse(c) for c in generic.chunks(last))
    assert frames.count("data: ") == 2 and '"finish_reason":"length"' in frames
