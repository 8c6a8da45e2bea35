"""A stream through the router's first-token path is, event for event, what a plain vLLM server
streams: the same keys in the same order, the same nulls, the same text and usage; only ids,
timestamps and the engine's fingerprint differ (newcomer issue: a byte-level diff against plain
vLLM showed the router's first chunk in its own schema, and continued chat chunks with
``stop_reason`` where vLLM has ``token_ids``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cluster import SERVED_NAME, Cluster, Plain
from tests.support.metrics import scrape, value
from tests.support.prompts import make_prompts

pytestmark = pytest.mark.vllm

VARYING = ("id", "created", "system_fingerprint")
"""Keys whose values differ between any two servers (the keys themselves must match)."""


def _events(base: str, endpoint: str, body: dict[str, Any]) -> list[str]:
    """The stream's data events, with the values of ``VARYING`` keys masked (order kept)."""
    with httpx.stream("POST", f"{base}/v1/{endpoint}", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line[5:].strip() for line in resp.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "[DONE]", lines[-3:]
    masked = []
    for line in lines[:-1]:
        event = json.loads(line)
        masked.append(json.dumps({k: ("*" if k in VARYING else v) for k, v in event.items()}))
    return [*masked, "[DONE]"]


def _first_token_streams(url: str) -> float:
    return value(scrape(url), "pdserve_router_paths_total", path="pd_first_token")


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("options", [
    None, {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}],
    ids=["plain", "usage", "continuous-usage"])
def test_a_first_token_stream_is_event_for_event_a_plain_servers(
        cluster: Cluster, plain: Plain, tiny_model_dir: Path, endpoint: str,
        options: dict[str, bool] | None) -> None:
    (prompt,) = make_prompts(tiny_model_dir, [300], seed=83, tag="schema")
    body: dict[str, Any] = {"model": SERVED_NAME, "max_tokens": 6, "temperature": 0,
                            "stream": True}
    if endpoint == "completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    if options is not None:
        body["stream_options"] = options
    before = _first_token_streams(cluster.url)
    ours, ref = _events(cluster.url, endpoint, body), _events(plain.url, endpoint, body)
    # the path under test: the prefill's token streamed at once, the decode continuing from it
    # (a whole request on one worker would be vLLM's own stream and prove nothing)
    assert _first_token_streams(cluster.url) == before + 1
    assert ours == ref
