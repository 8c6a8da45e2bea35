"""Fields only the router may set, and client chat templates, are refused before any worker
(or the router's own template renderer) sees them (security review findings 3, 7 and 20)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from router.api.tokenization import _render_chat
from tests.unit.test_router_validation import CHAT, MSG, C, client, tokenizer_dir

__all__ = ["client", "tokenizer_dir"]  # fixtures shared with the validation table

MARKER = "ZQXJV"
"""A word the tiny tokenizer splits into known pieces, rendered only by a client template."""
TEMPLATE = "{{ '" + MARKER + "' }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
BOMB = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize(("path", "extra", "code", "param"), [
    (C, {"kv_transfer_params": {"do_remote_prefill": True}}, "invalid_parameter",
     "kv_transfer_params"),
    (C, {"ec_transfer_params": {}}, "invalid_parameter", "ec_transfer_params"),
    (C, {"vllm_xargs": {"kv_transfer_params": "x"}}, "invalid_parameter",
     "vllm_xargs.kv_transfer_params"),
    (CHAT, {"vllm_xargs": {"kv_cache_report_mode": "full"}}, "invalid_parameter",
     "vllm_xargs.kv_cache_report_mode"),
    (CHAT, {"chat_template": BOMB}, "untrusted_chat_template", "chat_template"),
    (CHAT, {"chat_template_kwargs": {"chat_template": BOMB}}, "untrusted_chat_template",
     "chat_template_kwargs.chat_template"),
    (CHAT, {"chat_template_kwargs": {"tokenize": False}}, "invalid_parameter",
     "chat_template_kwargs.tokenize"),
    (CHAT, {"chat_template_kwargs": "x"}, "invalid_type", "chat_template_kwargs"),
    (C, {"prompt": [1, 2**32]}, "invalid_type", "prompt"),  # one message for the union
    (C, {"priority": -1}, "invalid_parameter", "priority"),  # the router's handoff rank
    (CHAT, {"priority": -100}, "invalid_parameter", "priority"),
    (C, {"priority": 1.5}, "invalid_parameter", "priority"),
    (C, {"priority": True}, "invalid_parameter", "priority"),
    (C, {"prompt": [[5, 2**40]]}, "invalid_type", "prompt"),
])
async def test_router_only_fields_and_templates_are_refused(
        client: httpx.AsyncClient, path: str, extra: dict[str, Any], code: str,
        param: str) -> None:
    base = {"model": "tiny", **({"messages": MSG} if path == CHAT else {"prompt": "hi"})}
    resp = await client.post(path, json={**base, **extra})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error")


@pytest.mark.parametrize("extra", [
    {"vllm_xargs": {"my_plugin_arg": "x"}},
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"prompt": [0, 2**32 - 1]},
    {"priority": 0},
    {"priority": 7},
])
async def test_what_clients_may_set_passes(client: httpx.AsyncClient,
                                           extra: dict[str, Any]) -> None:
    """Negative control: other xargs, template variables, the largest token id and a priority
    of 0 or more pass validation (the only worker is unreachable: 502)."""
    path = CHAT if "chat_template_kwargs" in extra else C
    base = {"model": "tiny", **({"messages": MSG} if path == CHAT else {"prompt": "hi"})}
    resp = await client.post(path, json={**base, **extra})
    assert resp.status_code == 502, resp.text


def test_the_renderer_ignores_a_client_template_it_would_otherwise_run(
        tokenizer_dir: Path) -> None:
    """Defence in depth behind the 400: the router's renderer drops ``chat_template`` from
    ``chat_template_kwargs``. Control: the tokenizer itself does run it when passed."""
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    marker_ids = tok(MARKER, add_special_tokens=False)["input_ids"]
    honoured = tok.apply_chat_template(MSG, chat_template=TEMPLATE, tokenize=True,
                                       add_generation_prompt=True)
    honoured = list(honoured["input_ids"] if hasattr(honoured, "keys") else honoured)
    assert _contains(honoured, marker_ids)
    ours = _render_chat(tok, MSG, {"chat_template_kwargs": {"chat_template": TEMPLATE}})
    assert not _contains(ours, marker_ids)
    assert ours == _render_chat(tok, MSG, {})


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


async def test_a_chunked_body_past_the_cap_is_refused_while_it_streams_in(
        client: httpx.AsyncClient) -> None:
    """Security review finding 12: a chunked upload (no Content-Length) is cut off once past
    ``max_body_bytes`` (8 MiB), not read whole into memory first. Control: a small chunked
    body is read and validated (the only worker is unreachable: 502)."""
    sent = 0

    async def upload(chunks: int, size: int = 65536) -> AsyncIterator[bytes]:
        nonlocal sent
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(chunks):
            sent += 1
            yield b"x " * (size // 2)
        yield b'"}'

    resp = await client.post(C, content=upload(1024))  # 64 MiB offered
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"]["code"] == "request_too_large"
    assert sent < 200  # stopped near 8 MiB (128 chunks), far from the 1,024 offered
    small = await client.post(C, content=upload(2, size=8))
    assert small.status_code == 502, small.text
