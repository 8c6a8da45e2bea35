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
CONTENT = ("text", "content", "prompt_tokens", "total_tokens", "completion_tokens")
"""Values that depend on where a chunk boundary falls: vLLM itself merges tokens into one
chunk when its engine runs ahead of its API server, so boundaries differ run to run."""


def _events(base: str, endpoint: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's data events (``[DONE]`` checked and dropped)."""
    with httpx.stream("POST", f"{base}/v1/{endpoint}", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line[5:].strip() for line in resp.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


def _shape(value: Any, key: str = "") -> Any:
    """``value`` with the values of ``VARYING`` and ``CONTENT`` keys masked, as JSON text (keys
    keep their order, so two shapes are equal only with the same keys in the same order)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_shape(v, k)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_shape(v) for v in value) + "]"
    return "*" if key in VARYING + CONTENT else json.dumps(value)


def _text(events: list[dict[str, Any]]) -> str:
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                   for e in events for c in e.get("choices") or [])


def _first_token_streams(url: str) -> float:
    return value(scrape(url), "pdserve_router_paths_total", path="pd_first_token")


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("options", [
    None, {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}],
    ids=["plain", "usage", "continuous-usage"])
def test_a_first_token_stream_is_event_for_event_a_plain_servers(
        cluster: Cluster, plain: Plain, tiny_model_dir: Path, endpoint: str,
        options: dict[str, bool] | None) -> None:
    """Each event of ours has the shape of the plain server's event at the same place (its
    first events exactly; the rest as vLLM streams tokens: the same keys in the same order),
    and the whole text and the final usage are equal."""
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
    assert _text(ours) == _text(ref)
    shapes, ref_shapes = [_shape(e) for e in ours], [_shape(e) for e in ref]
    head = 2 if endpoint == "chat/completions" else 1  # the router's own first chunk(s)
    assert shapes[:head] == ref_shapes[:head], (shapes[:head], ref_shapes[:head])
    # the last event (finish, or the usage chunk) and the token chunks between, as vLLM's
    assert shapes[-1] == ref_shapes[-1], (shapes[-1], ref_shapes[-1])
    assert set(shapes[head:-1]) <= set(ref_shapes[head - 1:-1]), (shapes, ref_shapes)
    if options:  # the usage both report, on the last chunk
        assert ours[-1]["usage"] == ref[-1]["usage"]
