"""Requests P/D does not split (``n > 1``, batched prompts) are served whole by one worker
through the router, with the answers a plain vLLM server gives (newcomer issue: requests vLLM
serves are no longer refused)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cluster import SERVED_NAME, Cluster, Plain
from tests.support.prompts import make_prompts

pytestmark = pytest.mark.vllm


def _texts(base: str, body: dict[str, Any]) -> list[tuple[int, str]]:
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    return sorted((c["index"], c["text"]) for c in data["choices"])


def test_n_and_batched_prompts_equal_a_plain_server(cluster: Cluster, plain: Plain,
                                                    tiny_model_dir: Path) -> None:
    short, long = make_prompts(tiny_model_dir, [20, 200], seed=41, tag="whole")
    # n > 1 needs sampling (vLLM refuses it with greedy): seeded, so both servers draw the same
    sampled = {"temperature": 0.8, "seed": 7}
    for extra in ({"prompt": long, "n": 2, **sampled}, {"prompt": [short, long], "temperature": 0},
                  {"prompt": [short, long], "n": 2, **sampled}):
        body = {"model": SERVED_NAME, "max_tokens": 8, **extra}
        ours, ref = _texts(cluster.url, body), _texts(plain.url, body)
        assert ours == ref, extra
        assert len(ours) == (2 if "n" in extra else 1) * (2 if isinstance(extra["prompt"], list)
                                                         else 1)
        if "n" in extra:  # two real samples, not one answer twice
            assert len({text for _, text in ours}) > 1, ours


def test_a_streamed_n_2_equals_a_plain_server(cluster: Cluster, plain: Plain) -> None:
    body = {"model": SERVED_NAME, "prompt": "the copper lantern", "max_tokens": 6,
            "temperature": 0.8, "seed": 7, "n": 2, "stream": True}

    def stream(base: str) -> dict[int, str]:
        texts: dict[int, str] = {}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        return texts

    ours = stream(cluster.url)
    assert ours == stream(plain.url) and set(ours) == {0, 1}
