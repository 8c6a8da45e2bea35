"""The phase timeline of real P/D requests: metrics, timeline files and one trace per request."""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtransfer.timeline import PHASES as KV_PHASES
from router.api.timeline import PHASES as ROUTER_PHASES
from tests.support.cluster import SERVED_NAME, Cluster
from tests.support.metrics import scrape, value
from tests.support.prompts import make_prompts
from tests.support.waiting import eventually

pytestmark = pytest.mark.vllm

DECODE_PHASES = [p for p in KV_PHASES if p.startswith("decode_")]
PREFILL_PHASES = [p for p in KV_PHASES if p.startswith("prefill_")]


def _stream(url: str, prompt: str, request_id: str) -> tuple[str, int]:
    """A streamed 6-token completion: its text and the output tokens its usage counts (not its
    chunks: vLLM merges deltas into one chunk when its reader lags, as in CI run 25, 5 chunks
    for 6 tokens)."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    text, tokens = "", 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120,
                      headers={"x-request-id": request_id}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += "".join(c.get("text", "") for c in chunk["choices"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return text, tokens


def _phase_counts(samples: Any, name: str, phases: list[str]) -> dict[str, float]:
    return {p: value(samples, f"{name}_count", phase=p) for p in phases}


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] \
        if path.exists() else []


def test_phases_of_a_pd_request_are_complete_and_add_up(
        cluster: Cluster, workers: dict[str, str], tiny_model_dir: Path) -> None:
    (prompt,) = make_prompts(tiny_model_dir, [300], seed=7, tag="timeline")
    r0, d0, p0 = scrape(cluster.url), scrape(workers["decode"]), scrape(workers["prefill"])
    rid = f"tl-{uuid.uuid4().hex}"
    text, tokens = _stream(cluster.url, prompt, rid)
    assert text and tokens == 6

    # Router: every phase once, and the phases add up to the request's end-to-end time.
    r1 = scrape(cluster.url)
    for phase in ROUTER_PHASES.values():
        assert value(r1, "pdserve_router_phase_seconds_count", phase=phase) - \
            value(r0, "pdserve_router_phase_seconds_count", phase=phase) == 1, phase
    phase_sum = sum(value(r1, "pdserve_router_phase_seconds_sum", phase=p)
                    - value(r0, "pdserve_router_phase_seconds_sum", phase=p)
                    for p in ROUTER_PHASES.values())
    e2e = value(r1, "pdserve_router_request_duration_seconds_sum") - \
        value(r0, "pdserve_router_request_duration_seconds_sum")
    assert e2e > 0 and phase_sum == pytest.approx(e2e, abs=1e-3)

    # Decode: every connector phase of the pull; prefill: every lease phase (the release
    # reaches the prefill's metrics with its next engine steps).
    def grew(url: str, phases: list[str], before: Any) -> bool:
        now = _phase_counts(scrape(url), "pdserve_kv_phase_seconds", phases)
        then = _phase_counts(before, "pdserve_kv_phase_seconds", phases)
        return all(now[p] - then[p] == 1 for p in phases)

    eventually(lambda: grew(workers["decode"], DECODE_PHASES, d0), bool, timeout_s=15)
    eventually(lambda: grew(workers["prefill"], PREFILL_PHASES, p0), bool, timeout_s=15)

    # The timeline files line the three processes up on the wall clock.
    (router_line,) = [x for x in _lines(cluster.router_timeline) if x["request_id"] == rid]
    events = router_line["events"]
    assert sum(router_line["phases"].values()) == pytest.approx(
        events["done"] - events["received"], abs=1e-3)
    kv = eventually(lambda: [x for x in _lines(cluster.kv_timeline) if rid in x["request_id"]],
                    lambda found: len(found) == 2, timeout_s=15)
    by_role = {x["role"]: x for x in kv}
    prefill, decode = by_role["prefill"]["events"], by_role["decode"]["events"]
    slack = 0.05  # clocks of one host; events are stamped a little after they happen
    assert events["prefill_chosen"] - slack <= prefill["admitted"]
    assert prefill["prefill_done"] <= events["prefill_answered"] + slack
    assert events["decode_chosen"] - slack <= decode["remote_seen"]
    assert decode["first_scheduled"] <= events["done"] + slack


def test_a_plain_request_has_no_connector_phases(cluster: Cluster, workers: dict[str, str],
                                                 tiny_model_dir: Path) -> None:
    """Negative control: a request straight to the decode worker pulls nothing, so a plain
    request followed by one P/D request adds exactly one set of decode phases."""
    d0 = scrape(workers["decode"])
    body = {"model": SERVED_NAME, "prompt": "a plain request " * 20, "max_tokens": 4,
            "temperature": 0}
    assert httpx.post(f"{workers['decode']}/v1/completions", json=body, timeout=120,
                      headers=cluster.worker_auth).status_code == 200
    (prompt,) = make_prompts(tiny_model_dir, [150], seed=9, tag="negative")
    _stream(cluster.url, prompt, f"neg-{uuid.uuid4().hex}")
    before = _phase_counts(d0, "pdserve_kv_phase_seconds", DECODE_PHASES)
    after = eventually(
        lambda: _phase_counts(scrape(workers["decode"]), "pdserve_kv_phase_seconds",
                              DECODE_PHASES),
        lambda now: all(now[p] > before[p] for p in DECODE_PHASES), timeout_s=15)
    assert all(after[p] - before[p] == 1 for p in DECODE_PHASES), (before, after)


def test_one_trace_across_router_prefill_and_decode(cluster: Cluster,
                                                    tiny_model_dir: Path) -> None:
    assert cluster.traces is not None
    (prompt,) = make_prompts(tiny_model_dir, [200], seed=8, tag="trace")
    rid = f"tr-{uuid.uuid4().hex}"
    _stream(cluster.url, prompt, rid)

    def trace_of_request() -> list[Any]:
        spans = cluster.traces.snapshot()  # type: ignore[union-attr]
        roots = [s for s in spans if s.name == "pdserve.request"
                 and s.attributes.get("pdserve.request_id") == rid]
        if not roots:
            return []
        return [s for s in spans if s.trace_id == roots[0].trace_id]

    def complete(spans: list[Any]) -> bool:
        names = {s.name for s in spans}
        return {"pdserve.request", "router.prefill", "router.stream", "pdserve.kv.decode",
                "pdserve.kv.prefill", "kv.decode_read"} <= names and \
            sum(1 for s in spans if s.service != "pdserve-router"
                and not s.name.startswith(("pdserve.kv", "kv."))) >= 2

    spans = eventually(trace_of_request, complete, timeout_s=30)
    root = next(s for s in spans if s.name == "pdserve.request")
    # vLLM's own request spans (prefill and decode servers) are children of the router's span
    vllm_spans = [s for s in spans if s.parent_span_id == root.span_id
                  and s.service != "pdserve-router" and not s.name.startswith("pdserve.")]
    assert len(vllm_spans) >= 2, [(s.service, s.name) for s in spans]
    for s in spans:
        assert s.start_ns <= s.end_ns


def test_a_lease_is_granted_before_the_next_prefill_runs(
        cluster: Cluster, tiny_model_dir: Path) -> None:
    """A finished prefill's lease is granted when the next engine step starts, not when it
    ends: vLLM starts a connector's (asynchronous) loads only after the forward, and on CPU the
    forward is the whole step, so a grant taken there waited for the next request's prefill
    (200-400 ms of handoff, the decode's release waiting on the grant). Two long prompts sent
    together: the second's prefill ends a step or more after the first's; the first's lease
    must be granted early in that span (before the fix it came at its end)."""
    first, second = make_prompts(tiny_model_dir, [1800, 1800], seed=11, tag="grant")
    ids = [f"gr-{uuid.uuid4().hex}", f"gr-{uuid.uuid4().hex}"]
    with ThreadPoolExecutor(2) as pool:
        done = [pool.submit(_stream, cluster.url, first, ids[0])]
        time.sleep(0.05)  # the first is admitted first; the second queues behind it
        done.append(pool.submit(_stream, cluster.url, second, ids[1]))
        assert all(f.result()[1] == 6 for f in done)

    def prefill_events(rid: str) -> dict[str, float] | None:
        found = [x["events"] for x in _lines(cluster.kv_timeline)
                 if rid in x["request_id"] and x["role"] == "prefill"]
        return found[0] if found else None

    a = eventually(lambda: prefill_events(ids[0]), bool, timeout_s=15)
    b = eventually(lambda: prefill_events(ids[1]), bool, timeout_s=15)
    assert a is not None and b is not None
    span = b["prefill_done"] - a["prefill_done"]
    # the set-up holds: the second prompt's prefill ran (at least partly) after the first's
    assert span > 0.05, (a, b)
    assert a["lease_granted"] - a["prefill_done"] < 0.5 * span, (a, b)
