"""Property-based fuzzing of the router's OpenAI API against the real cluster: whatever the
body, the answer is never a 5xx, every error is OpenAI's envelope, and the workers survive.

``PDSERVE_FUZZ_EXAMPLES`` sets the number of cases (default 150 in the suite); with
``PDSERVE_FUZZ_REPORT=path`` the statuses seen are written there as JSON.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.cluster import SERVED_NAME, Cluster

pytestmark = pytest.mark.vllm

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "150"))
SEEN: Counter[int] = Counter()

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
anything = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8)
tokens = st.integers(-5, 40_000)
prompts = st.one_of(st.text(max_size=200), st.lists(tokens, max_size=40),
                    st.lists(st.text(max_size=30), max_size=3),
                    st.lists(st.lists(tokens, max_size=10), max_size=3), anything)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "", "robot"]),
     "content": st.one_of(st.text(max_size=80), anything)}), max_size=3)
small = st.one_of(st.integers(-3, 6), st.floats(-2, 3, allow_nan=False), anything)
sampling = {
    "max_tokens": st.one_of(st.integers(-2, 4), st.integers(10**6, 10**9), anything),
    "temperature": small, "top_p": small, "top_k": small, "n": st.one_of(st.integers(-1, 3),
                                                                          anything),
    "stream": st.one_of(st.booleans(), anything), "stop": st.one_of(st.text(max_size=5),
                                                                     anything),
    "logprobs": small, "seed": st.one_of(st.integers(-2**63, 2**64), anything),
    "presence_penalty": small, "ignore_eos": st.booleans(), "echo": st.booleans(),
    "stream_options": anything, "min_tokens": small, "logit_bias": anything,
}


def _body(kind: str) -> st.SearchStrategy[dict[str, Any]]:
    required = {"model": st.one_of(st.just(SERVED_NAME), st.text(max_size=12), anything)}
    required["prompt" if kind == "completions" else "messages"] = \
        prompts if kind == "completions" else st.one_of(messages, anything)
    return st.fixed_dictionaries(required, optional=sampling)


def _check(cluster: Cluster, path: str, body: Any) -> None:
    raw = json.dumps(body).encode()
    with httpx.stream("POST", cluster.url + path, content=raw, timeout=120,
                      headers={"content-type": "application/json"}) as resp:
        data = resp.read()
    SEEN[resp.status_code] += 1
    assert resp.status_code < 500, (body, data[:500])
    if resp.status_code >= 400:
        error = json.loads(data)["error"]
        # the stable envelope, also for what only a worker refuses (router.api.upstream_errors)
        assert error["message"] and isinstance(error["code"], str), error
        assert not str(error["param"] or "").startswith("body"), error


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(kind=st.sampled_from(["completions", "chat"]), wild=st.booleans(), data=st.data())
def test_fuzzed_bodies_never_get_a_5xx(cluster: Cluster, kind: str, wild: bool,
                                       data: st.DataObject) -> None:
    """Half the cases are arbitrary bodies; half a valid request with up to three fields
    replaced by fuzzed values (so the fuzzing reaches the workers, not only validation)."""
    if wild:
        body = data.draw(st.one_of(_body(kind), anything))
    else:
        body = {"model": SERVED_NAME, "max_tokens": 3, "temperature": 0}
        if kind == "completions":
            body["prompt"] = data.draw(st.text(min_size=1, max_size=60))
        else:
            body["messages"] = [{"role": "user", "content": data.draw(st.text(max_size=60))}]
        keys = data.draw(st.lists(st.sampled_from(sorted(sampling)), max_size=3, unique=True))
        for key in keys:
            body[key] = data.draw(sampling[key])
    _check(cluster, "/v1/completions" if kind == "completions" else "/v1/chat/completions", body)


def test_cluster_still_serves_after_fuzzing(cluster: Cluster) -> None:
    """Runs after the fuzzing: the workers survived it, and the fuzzer reached both valid and
    invalid bodies (a fuzzer that only produced 400s would prove little)."""
    resp = httpx.post(cluster.url + "/v1/completions", timeout=60, json={
        "model": SERVED_NAME, "prompt": "still alive", "max_tokens": 3})
    assert resp.status_code == 200, resp.text
    assert SEEN[200] > 0 and sum(n for s, n in SEEN.items() if 400 <= s < 500) > 0, SEEN
    report = os.environ.get("PDSERVE_FUZZ_REPORT")
    if report:
        with open(report, "w") as fh:
            json.dump({str(k): v for k, v in sorted(SEEN.items())}, fh)
