"""Usage and inter-token gaps read from relayed answers, against hand-computed values."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.api.usage import StreamWatch, Usage, body_usage, has_content, usage_of


def ev(data: dict[str, Any] | str) -> bytes:
    return b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n"


def text(t: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": t}]}


def test_gaps_between_content_events_across_chunk_boundaries() -> None:
    stream = [ev({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
              ev(text("a")), ev(text("b")), ev({"choices": [{"index": 0, "text": "",
                                                             "finish_reason": "length"}]}),
              ev(text("c")), ev({"choices": [], "usage": {"prompt_tokens": 5,
                                                          "completion_tokens": 3}}),
              ev("[DONE]")]
    raw = b"".join(stream)
    watch = StreamWatch()
    # Split mid-event: "b" completes in the second chunk, at t=2.0; "c" and usage at t=5.0.
    cut1 = len(b"".join(stream[:2])) + 4
    cut2 = len(b"".join(stream[:4])) + 7
    watch.feed(raw[:cut1], 1.0)
    watch.feed(raw[cut1:cut2], 2.0)
    watch.feed(raw[cut2:], 5.0)
    assert watch.gaps == pytest.approx([1.0, 3.0])  # a@1 -> b@2 -> c@5; role/finish: no text
    assert watch.usage == Usage(5, 3)


def test_crlf_framing_and_continuous_usage_keeps_the_last() -> None:
    watch = StreamWatch()
    for i, t in enumerate(("x", "y", "z")):
        data = {**text(t), "usage": {"prompt_tokens": 4, "completion_tokens": i + 1}}
        watch.feed(b"data: " + json.dumps(data).encode() + b"\r\n\r\n", float(i) * 0.5)
    assert watch.gaps == pytest.approx([0.5, 0.5]) and watch.usage == Usage(4, 3)


def test_no_usage_no_content_and_garbage() -> None:
    watch = StreamWatch()
    watch.feed(b": keep-alive\n\n" + ev("not json") + ev({"error": {"message": "x"}}), 0.0)
    watch.feed(b"x" * ((1 << 20) + 1), 1.0)  # no event boundary: dropped, not kept forever
    assert watch.gaps == [] and watch.usage is None and watch._buf == b""


@pytest.mark.parametrize(("body", "want"), [
    (b'{"usage": {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13}}',
     Usage(7, 6)),
    (b'{"choices": []}', None),
    (b'{"usage": null}', None),
    (b'{"usage": {"prompt_tokens": 7}}', None),
    (b'{"usage": broken', None),
])
def test_body_usage(body: bytes, want: Usage | None) -> None:
    assert body_usage(body) == want


def test_has_content_and_usage_of() -> None:
    assert has_content({"choices": [{"delta": {"reasoning_content": "r"}}]})
    assert has_content({"choices": [{"delta": {"tool_calls": [{"id": "t"}]}}]})
    assert not has_content({"choices": [{"delta": {"content": ""}}]})
    assert not has_content({"choices": None})
    assert usage_of([1]) is None and usage_of({"usage": {"prompt_tokens": "7",
                                                         "completion_tokens": 1}}) is None
