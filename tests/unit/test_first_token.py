"""Streaming the prefill's token: who qualifies, and what the prefill's answer gives."""

from __future__ import annotations

from typing import Any

import pytest

from router.api.first_token import (
    FirstToken,
    eligible,
    parse_prefill,
    resumable,
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
    # a stream that can start from the prefill's token can go on from any later one
    assert not ok or resumable(COMPLETIONS, body)


def test_a_one_token_stream_cannot_start_from_the_prefill_but_can_move() -> None:
    assert resumable(COMPLETIONS, {**BASE, "max_tokens": 1})
    assert not resumable(COMPLETIONS, {**BASE, "stop": ["\n"]})


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
