"""Prefill/decode body rewriting, checked against literal dicts."""

from __future__ import annotations

from router.api.rewrite import HANDOFF_PRIORITY, decode_body, prefill_body
from router.api.schemas import CHAT_COMPLETIONS, COMPLETIONS

KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [4, 5],
      "remote_engine_id": "e1", "remote_request_id": "rid", "remote_host": "10.0.0.1",
      "remote_port": 5600}


def test_prefill_body_completions() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 3, "temperature": 0.7,
            "seed": 1, "kv_transfer_params": {"client": "junk"}}
    assert prefill_body(COMPLETIONS, body) == {
        "model": "m", "prompt": "hi", "max_tokens": 1, "stream": False, "temperature": 0.7,
        "seed": 1, "kv_transfer_params": {"do_remote_decode": True},
    }
    assert body["max_tokens"] == 50 and "stream_options" in body, "input must not be mutated"


def test_prefill_body_chat_caps_both_token_fields() -> None:
    msgs = [{"role": "user", "content": "hello"}]
    body = {"model": "m", "messages": msgs, "max_completion_tokens": 20}
    assert prefill_body(CHAT_COMPLETIONS, body) == {
        "model": "m", "messages": msgs, "max_tokens": 1, "max_completion_tokens": 1,
        "stream": False, "kv_transfer_params": {"do_remote_decode": True},
    }


def test_prefill_body_has_fresh_params_each_time() -> None:
    a = prefill_body(COMPLETIONS, {"model": "m", "prompt": "x"})
    a["kv_transfer_params"]["x"] = 1
    b = prefill_body(COMPLETIONS, {"model": "m", "prompt": "x"})
    assert b["kv_transfer_params"] == {"do_remote_decode": True}


def test_decode_body_is_original_plus_params() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 3}
    assert decode_body(body, KV) == {
        "model": "m", "prompt": "hi", "max_tokens": 50, "stream": True,
        "stream_options": {"include_usage": True}, "min_tokens": 3, "kv_transfer_params": KV,
        "priority": HANDOFF_PRIORITY,
    }
    assert "kv_transfer_params" not in body and "priority" not in body


def test_a_handoff_runs_ahead_of_any_priority_a_client_may_set() -> None:
    """The decode of a pulled prefill outranks the client's own priority (vLLM: lower runs
    earlier), which the router keeps at 0 or above; the prefill keeps the client's."""
    body = {"model": "m", "prompt": "hi", "priority": 3}
    assert decode_body(body, KV)["priority"] == HANDOFF_PRIORITY < 0
    assert prefill_body(COMPLETIONS, body)["priority"] == 3
