"""Streaming the prefill's token: who qualifies, the decode's continuation, the stitched stream."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.api.first_token import (
    ContinuationRewriter,
    FirstToken,
    continuation_body,
    eligible,
    first_events,
    parse_prefill,
)
from router.api.schemas import CHAT_COMPLETIONS, COMPLETIONS

BASE = {"model": "m", "prompt": "hello", "stream": True, "max_tokens": 8, "temperature": 0}


@pytest.mark.parametrize(("change", "ok"), [
    ({}, True),
    ({"prompt": [1, 2, 3]}, True),
    ({"max_tokens": None}, True),
    ({"stream_options": {"include_usage": True}, "ignore_eos": True, "top_k": 5}, True),
    ({"seed": 3, "temperature": 0}, True),
    ({"stream": False}, False),  # nothing to stream early
    ({"max_tokens": 1}, False),  # the prefill's token is the whole answer
    ({"stop": ["\n"]}, False),  # a stop string may span the first and second token
    ({"logprobs": 2}, False),
    ({"echo": True}, False),
    ({"presence_penalty": 0.5}, False),  # penalties count the first token as output
    ({"seed": 3, "temperature": 0.7}, False),  # one generator must draw every token
    ({"n": 2}, False),
    ({"response_format": {"type": "json_object"}}, False),  # unknown field: classic P/D
    ({"prompt": ["a", "b"]}, False),
])
def test_completion_eligibility(change: dict[str, Any], ok: bool) -> None:
    body = {**BASE, **change}
    body = {k: v for k, v in body.items() if v is not None}
    assert eligible(COMPLETIONS, body) is ok


def test_chat_eligibility() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert eligible(CHAT_COMPLETIONS, chat)
    assert eligible(CHAT_COMPLETIONS, {**chat, "max_completion_tokens": 5})
    assert not eligible(CHAT_COMPLETIONS, {**chat, "max_completion_tokens": 1})
    assert not eligible(CHAT_COMPLETIONS, {**chat, "tools": [{"type": "function"}]})
    assert eligible(CHAT_COMPLETIONS, {**chat, "tool_choice": "none"})


def _prefill(**choice: Any) -> dict[str, Any]:
    return {"id": "cmpl-r1", "created": 7, "model": "m", "choices": [
        {"index": 0, "text": " world", "finish_reason": "length", "token_ids": [42],
         "prompt_token_ids": [1, 2, 3], **choice}], "kv_transfer_params": {"x": 1}}


def test_parse_prefill_and_the_cases_that_fall_back() -> None:
    first = parse_prefill(_prefill())
    assert first == FirstToken("cmpl-r1", 7, "m", " world", 42, (1, 2, 3))
    assert parse_prefill(_prefill(finish_reason="stop")) is None  # EOS: classic P/D
    assert parse_prefill(_prefill(text="\ufffd")) is None  # half a UTF-8 character
    assert parse_prefill(_prefill(text="")) is None  # the detokenizer holds a partial character
    assert parse_prefill(_prefill(token_ids=None)) is None  # worker without token ids
    chat = {"id": "chatcmpl-r1", "created": 7, "model": "m", "prompt_token_ids": [5, 6],
            "choices": [{"message": {"role": "assistant", "content": "x"}, "token_ids": [9],
                         "finish_reason": "length"}]}
    assert parse_prefill(chat) == FirstToken("chatcmpl-r1", 7, "m", "x", 9, (5, 6))


def test_continuation_body_extends_the_prompt_and_takes_one_token_less() -> None:
    first = FirstToken("cmpl-r1", 7, "m", " world", 42, (1, 2, 3))
    body = {**BASE, "min_tokens": 4, "stream_options": {"include_usage": True}}
    out = continuation_body(body, first, {"remote": True})
    assert out == {"model": "m", "prompt": [1, 2, 3, 42], "max_tokens": 7, "min_tokens": 3,
                   "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                   "kv_transfer_params": {"remote": True}}
    chat = {"model": "m", "messages": [], "stream": True, "max_completion_tokens": 3}
    assert continuation_body(chat, first, {})["max_tokens"] == 2


def _events(raw: bytes) -> list[Any]:
    out = []
    for event in raw.decode().split("\n\n"):
        if event.startswith("data: "):
            payload = event[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_completion_stream_counts_the_first_token_as_output() -> None:
    first = FirstToken("cmpl-r1", 7, "m", " world", 42, (1, 2, 3))
    rw = ContinuationRewriter(COMPLETIONS, first)
    decode = (b'data: {"id":"cmpl-r1","created":8,"model":"m","choices":[{"index":0,'
              b'"text":" again","finish_reason":null}]}\n\n'
              b'data: {"id":"cmpl-r1","created":8,"model":"m","choices":[],'
              b'"usage":{"prompt_tokens":4,"completion_tokens":7,"total_tokens":11}}\n\n'
              b"data: [DONE]\n\n")
    # delivered in arbitrary pieces, as TCP does
    raw = b"".join(rw.feed(decode[i:i + 7]) for i in range(0, len(decode), 7)) + rw.flush()
    head, body, usage, done = _events(first_events(COMPLETIONS, first) + raw)
    assert head["choices"][0]["text"] == " world"
    assert body["choices"][0]["text"] == " again"
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}
    assert done == "[DONE]"


def test_chat_stream_gets_chat_chunks_under_the_prefill_id() -> None:
    first = FirstToken("chatcmpl-r1", 7, "m", "Hi", 9, (5, 6))
    rw = ContinuationRewriter(CHAT_COMPLETIONS, first)
    raw = rw.feed(b'data: {"id":"cmpl-r1","object":"text_completion","created":8,"model":"m",'
                  b'"choices":[{"index":0,"text":" there","finish_reason":"length"}]}\n\n')
    role, content, more = _events(first_events(CHAT_COMPLETIONS, first) + raw)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert content["choices"][0]["delta"] == {"content": "Hi"}
    assert more["object"] == "chat.completion.chunk" and more["id"] == "chatcmpl-r1"
    assert more["choices"][0]["delta"] == {"content": " there"}
    assert more["choices"][0]["finish_reason"] == "length"
