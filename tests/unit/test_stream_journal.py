"""The journal of a resumable stream: the ids it records, the events it relays, and the
continuation that goes on from them (``router.api.journal``)."""

from __future__ import annotations

import json
from typing import Any

from router.api.first_token import FirstToken, first_events
from router.api.journal import StreamJournal, continuation_body
from router.api.rewrite import HANDOFF_PRIORITY
from router.api.schemas import CHAT_COMPLETIONS, COMPLETIONS

BASE = {"model": "m", "prompt": "hello", "stream": True, "max_tokens": 8, "temperature": 0}


def _events(raw: bytes) -> list[Any]:
    out = []
    for event in raw.decode().split("\n\n"):
        if event.startswith("data: "):
            payload = event[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def _chunk(text: str, ids: list[int], finish: str | None = None, *, first: bool = False,
           id_: str = "cmpl-a") -> bytes:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                              "finish_reason": finish, "stop_reason": None,
                              "prompt_token_ids": [1, 2, 3] if first else None,
                              "token_ids": ids}
    return b"data: " + json.dumps({"id": id_, "object": "text_completion", "created": 8,
                                   "model": "m", "choices": [choice]}).encode() + b"\n\n"


def test_continuation_body_goes_on_from_the_generated_ids_for_what_is_left() -> None:
    body = {**BASE, "min_tokens": 4, "stream_options": {"include_usage": True}}
    out = continuation_body(body, (1, 2, 3), (42,), {"remote": True})
    assert out == {"model": "m", "prompt": [1, 2, 3, 42], "max_tokens": 7, "min_tokens": 3,
                   "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                   "kv_transfer_params": {"remote": True}, "priority": HANDOFF_PRIORITY}
    chat = {"model": "m", "messages": [], "stream": True, "max_completion_tokens": 3}
    assert continuation_body(chat, (1,), (42,), {})["max_tokens"] == 2
    later = continuation_body(body, (1, 2, 3), (42, 43, 44, 45, 46), None, token_ids=True)
    assert later["prompt"] == [1, 2, 3, 42, 43, 44, 45, 46] and later["max_tokens"] == 3
    assert later["min_tokens"] == 0 and later["return_token_ids"] is True
    assert "kv_transfer_params" not in later and "priority" not in later
    own = continuation_body({**body, "priority": 4}, (1, 2, 3), (42,), None)
    assert own["priority"] == 4  # no KV to pull: the client's own rank, as on its first worker


def test_native_stream_records_ids_and_relays_them_as_a_plain_stream_would() -> None:
    journal = StreamJournal(COMPLETIONS, BASE)
    journal.begin(native=True)
    raw = _chunk(" a", [10], first=True) + _chunk(" b", [11])
    # delivered in arbitrary pieces, as TCP does
    out = b"".join(journal.feed(raw[i:i + 5]) for i in range(0, len(raw), 5))
    first, second = _events(out)
    assert journal.prompt_ids == (1, 2, 3) and journal.committed == [10, 11]
    assert first["choices"][0]["token_ids"] is None  # as without return_token_ids
    assert first["choices"][0]["prompt_token_ids"] is None
    assert second["choices"][0]["text"] == " b" and journal.response_id == "cmpl-a"
    assert journal.resumable and journal.remaining() == 6
    assert journal.continuation()["prompt"] == [1, 2, 3, 10, 11]


def test_ids_whose_text_is_held_back_are_not_carried() -> None:
    journal = StreamJournal(COMPLETIONS, BASE)
    journal.begin(native=True)
    journal.feed(_chunk(" a", [10], first=True) + _chunk("", [200]))  # half a character
    assert journal.committed == [10] and journal.pending == [200]
    journal.feed(_chunk("é", [201]))
    assert journal.committed == [10, 200, 201] and journal.pending == []


def test_error_events_and_early_done_are_kept_from_the_client() -> None:
    journal = StreamJournal(COMPLETIONS, BASE)
    journal.begin(native=True)
    out = journal.feed(_chunk(" a", [10], first=True)
                       + b'data: {"error": {"message": "engine dead"}}\n\ndata: [DONE]\n\n')
    assert [e["choices"][0]["text"] for e in _events(out)] == [" a"]  # no error, no [DONE]
    assert journal.error == "engine dead" and not journal.done
    journal.begin(native=False)
    assert journal.error is None
    assert journal.feed(b"data: [DONE]\n\n") == b"" and not journal.done  # truncated
    done = journal.feed(_chunk(" b", [11], "length") + b"data: [DONE]\n\n")
    assert _events(done)[-1] == "[DONE]" and journal.done


def test_a_continuation_is_rewritten_under_the_stream_id_with_usage_counted_once() -> None:
    journal = StreamJournal(COMPLETIONS, BASE)
    journal.begin(native=True)
    journal.feed(_chunk(" a", [10], first=True) + _chunk(" b", [11]))
    journal.begin(native=False)  # the worker died; another goes on from [1, 2, 3, 10, 11]
    out = journal.feed(_chunk(" c", [12], "length", first=True, id_="cmpl-b")
                       + b'data: {"id":"cmpl-b","created":9,"model":"m","choices":[],'
                       b'"usage":{"prompt_tokens":5,"completion_tokens":6,'
                       b'"total_tokens":11}}\n\ndata: [DONE]\n\n')
    more, usage, done = _events(out)
    assert more["id"] == "cmpl-a" and more["choices"][0]["text"] == " c"
    assert more["choices"][0]["token_ids"] is None
    assert journal.prompt_ids == (1, 2, 3)  # a continuation's prompt is not the client's
    assert usage["id"] == "cmpl-a"
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}
    assert done == "[DONE]" and journal.done and journal.committed == [10, 11, 12]


def test_a_worker_that_sends_no_ids_cannot_be_continued() -> None:
    journal = StreamJournal(COMPLETIONS, BASE)
    journal.begin(native=True)
    journal.feed(b'data: {"id":"x","choices":[{"index":0,"text":" a","prompt_token_ids":[1],'
                 b'"finish_reason":null}]}\n\n')
    assert not journal.resumable  # the client saw text whose ids nobody knows
    assert StreamJournal(COMPLETIONS, BASE).resumable is False  # no prompt ids yet


def test_cap_reached_by_committed_ids_ends_the_stream_with_a_length_finish() -> None:
    journal = StreamJournal(COMPLETIONS, {**BASE, "max_tokens": 2})
    journal.begin(native=True)
    journal.feed(_chunk(" a", [10], first=True) + _chunk(" b", [11]))
    assert journal.remaining() == 0
    finish, done = _events(journal.finish_event())
    assert finish["id"] == "cmpl-a" and finish["choices"][0]["finish_reason"] == "length"
    assert done == "[DONE]" and journal.done


def test_completion_stream_from_the_prefill_counts_the_first_token_as_output() -> None:
    first = FirstToken("cmpl-r1", 7, "m", " world", 42, (1, 2, 3))
    journal = StreamJournal(COMPLETIONS, BASE, prompt_ids=first.prompt_token_ids,
                            committed=(first.token_id,), response_id=first.response_id)
    journal.begin(native=False)
    decode = (b'data: {"id":"cmpl-r1","created":8,"model":"m","choices":[{"index":0,'
              b'"text":" again","finish_reason":null,"token_ids":[43]}]}\n\n'
              b'data: {"id":"cmpl-r1","created":8,"model":"m","choices":[],'
              b'"usage":{"prompt_tokens":4,"completion_tokens":7,"total_tokens":11}}\n\n'
              b"data: [DONE]\n\n")
    raw = b"".join(journal.feed(decode[i:i + 7]) for i in range(0, len(decode), 7))
    raw += journal.flush()
    head, body, usage = _events(first_events(COMPLETIONS, first) + raw)
    assert head["choices"][0]["text"] == " world"
    assert body["choices"][0]["text"] == " again" and journal.committed == [42, 43]
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}
    assert not journal.done  # [DONE] with no finish: the decode stopped short


def test_chat_stream_gets_chat_chunks_under_the_prefill_id() -> None:
    first = FirstToken("chatcmpl-r1", 7, "m", "Hi", 9, (5, 6))
    journal = StreamJournal(CHAT_COMPLETIONS, {"model": "m", "messages": [], "stream": True},
                            prompt_ids=first.prompt_token_ids, committed=(9,),
                            response_id=first.response_id)
    journal.begin(native=False)
    raw = journal.feed(b'data: {"id":"cmpl-r1","object":"text_completion","created":8,'
                       b'"model":"m","choices":[{"index":0,"text":"","token_ids":[300],'
                       b'"finish_reason":null}]}\n\n'
                       b'data: {"id":"cmpl-r1","object":"text_completion","created":8,'
                       b'"model":"m","choices":[{"index":0,"text":" there","token_ids":[301],'
                       b'"finish_reason":"length"}]}\n\n')
    role, content, more = _events(first_events(CHAT_COMPLETIONS, first) + raw)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert content["choices"][0]["delta"] == {"content": "Hi"}
    assert more["object"] == "chat.completion.chunk" and more["id"] == "chatcmpl-r1"
    assert more["choices"][0]["delta"] == {"content": " there"}  # the empty event was dropped
    assert more["choices"][0]["finish_reason"] == "length"
    assert journal.committed == [9, 300, 301]


def test_native_chat_stream_takes_the_prompt_ids_from_its_first_chunk() -> None:
    journal = StreamJournal(CHAT_COMPLETIONS, {"model": "m", "messages": [], "stream": True})
    journal.begin(native=True)
    out = journal.feed(
        b'data: {"id":"chatcmpl-a","object":"chat.completion.chunk","choices":[{"index":0,'
        b'"delta":{"role":"assistant","content":""},"finish_reason":null}],'
        b'"prompt_token_ids":[7,8]}\n\n'
        b'data: {"id":"chatcmpl-a","object":"chat.completion.chunk","choices":[{"index":0,'
        b'"delta":{"content":"Yo"},"finish_reason":null,"token_ids":[70]}]}\n\n')
    role, content = _events(out)
    assert role["prompt_token_ids"] is None and content["choices"][0]["token_ids"] is None
    assert journal.prompt_ids == (7, 8) and journal.committed == [70]
    assert journal.continuation()["prompt"] == [7, 8, 70]
