"""Adaptive disaggregation on a real cluster: `pdserve up --mode adaptive --replicas 2`.

Two flex workers (one vLLM engine each, with our connector) behind the cluster's router, which
plans every request's path (``router.policy.adaptive``). Two more routers on the same Redis force
each path (``--path-policy whole`` / ``pd``), so every path is run through the OpenAI SDK and
compared with the session's plain vLLM server; a third, with a tight TPOT SLO, sees a burst of
long prompts with short answers and then short prompts with long answers.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cluster import (
    SERVED_NAME,
    Cluster,
    Plain,
    foreign_lines,
    registered_records,
    running_cluster,
)
from tests.support.metrics import scrape, value
from tests.support.prompts import make_prompts
from tests.support.router_process import RouterProcess
from tests.support.waiting import eventually

pytestmark = pytest.mark.vllm

WORKERS = 2


@pytest.fixture(scope="module")
def adaptive(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Cluster]:
    # a quiet start: the children write to log files (stop_cluster checks a quiet stop too)
    tmp = tmp_path_factory.mktemp("adaptive")
    with running_cluster(tiny_model_dir, tmp, instrument=True, expect_workers=WORKERS,
                         log_dir=tmp / "logs",
                         extra_args=("--mode", "adaptive", "--replicas", str(WORKERS))) as c:
        yield c


def test_a_quiet_start_keeps_the_childrens_output_in_their_log_files(
        adaptive: Cluster, cluster: Cluster) -> None:
    """With ``--log-dir``, the terminal up to the ready line is `pdserve up`'s own lines; each
    child's output (vLLM's included) is in its own file. Control: the session cluster, whose
    children write to the terminal, shows their lines there."""
    ready = next(i for i, line in enumerate(adaptive.output) if "pdserve ready:" in line)
    assert foreign_lines(adaptive.output[:ready + 2]) == [], "".join(adaptive.output[:ready + 2])
    assert adaptive.output[ready + 1].startswith(f"pdserve logs: {adaptive.log_dir} ")
    assert adaptive.log_dir is not None
    logs = {p.name: p.read_text(errors="replace") for p in adaptive.log_dir.glob("*.log")}
    flex = [name for name in logs if name.startswith("flex-")]
    assert len(flex) == WORKERS and "router.log" in logs, sorted(logs)
    assert "router ready" in logs["router.log"]
    for name in flex:  # the worker's own lines and vLLM's
        assert '"event": "worker_ready"' in logs[name], logs[name][-2000:]
        assert "Application startup complete" in logs[name], logs[name][-2000:]
    assert foreign_lines(cluster.output), "the control cluster's children print nothing"
    assert any("Application startup complete" in line for line in cluster.output)


@contextmanager
def _router(cluster: Cluster, **settings: Any) -> Iterator[str]:
    """Another router on ``cluster``'s Redis and secret (``settings``: RouterSettings fields)."""
    router = RouterProcess(redis_url=cluster.redis_url,
                           cluster_secret_file=str(cluster.keyring_file), **settings)
    router.start(timeout_s=60)
    try:
        yield router.url
    finally:
        router.stop()


def _paths(url: str) -> dict[tuple[str, str], float]:
    """``pdserve_router_paths_total`` by (path, reason), non-zero ones."""
    return {(dict(labels)["path"], dict(labels)["reason"]): v
            for (name, labels), v in scrape(url).items()
            if name == "pdserve_router_paths_total" and v}


def _grew(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
          ) -> dict[tuple[str, str], float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def _pulls(cluster: Cluster) -> float:
    """KV pulls done by the cluster's workers (both: either may decode)."""
    return sum(value(scrape(r.http_url), "pdserve_kv_pulls_total")
               for r in registered_records(cluster))


def _step_engines(cluster: Cluster) -> None:
    """One whole one-token request straight to each worker: its engine steps, and ships the
    transfer counters of its last steps to its /metrics (it pulls nothing itself)."""
    for r in registered_records(cluster):
        body = {"model": SERVED_NAME, "prompt": "step", "max_tokens": 1}
        httpx.post(f"{r.http_url}/v1/completions", json=body, headers=cluster.worker_auth,
                   timeout=60).raise_for_status()


def _sdk_outputs(url: str, prompt: str) -> list[str]:
    """Completion, streamed completion, chat and streamed chat of ``prompt`` (greedy)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    done = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=8,
                                     temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        if c.choices)
    messages = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(model=SERVED_NAME, messages=messages,  # type: ignore
                                          max_tokens=8, temperature=0)
    chat_streamed = "".join(c.choices[0].delta.content or "" for c in
                            client.chat.completions.create(
                                model=SERVED_NAME, messages=messages,  # type: ignore[arg-type]
                                max_tokens=8, temperature=0, stream=True) if c.choices)
    return [done.choices[0].text, streamed, chat.choices[0].message.content or "",
            chat_streamed]


def test_adaptive_mode_starts_flex_workers(adaptive: Cluster) -> None:
    roles = [r.role for r in registered_records(adaptive)]
    assert roles == ["flex"] * WORKERS
    health = httpx.get(f"{adaptive.url}/health").json()
    assert (health["flex_workers"], health["prefill_workers"], health["decode_workers"]) == (
        WORKERS, 0, 0)


def test_every_path_equals_a_plain_server(adaptive: Cluster, plain: Plain,
                                          tiny_model_dir: Path) -> None:
    prompts = make_prompts(tiny_model_dir, [40, 300], seed=21, tag="adaptive")
    reference = {p: _sdk_outputs(plain.url, p) for p in prompts}
    assert all(all(reference[p]) for p in prompts)
    with _router(adaptive, path_policy="whole") as whole, \
            _router(adaptive, path_policy="pd") as pd:
        for url, name in ((adaptive.url, "auto"), (whole, "whole"), (pd, "pd")):
            before, pulls = _paths(url), _pulls(adaptive)
            for prompt in prompts:
                assert _sdk_outputs(url, prompt) == reference[prompt], (name, prompt)
            grew, pulled = _grew(before, _paths(url)), _pulls(adaptive) - pulls
            assert sum(grew.values()) == 4 * len(prompts), (name, grew)
            if name == "whole":
                assert set(grew) == {("whole", "forced")}, grew
                assert pulled == 0  # negative control: nothing moved between the engines
            elif name == "pd":
                assert {path for path, _ in grew} <= {"pd", "pd_first_token"}, grew
                assert {reason for _, reason in grew} == {"forced"}, grew
                # each answer's KV really was pulled: a worker's transfer counters reach its
                # /metrics with its engine's next step, so wait for them (CI run 17 read 4 of
                # 8 at once), stepping idle engines with a one-token request (CI run 25 read 4
                # for 60 s: no step came), then check the exact count
                def pulled_now() -> float:
                    n = _pulls(adaptive) - pulls  # noqa: B023
                    if n < 4 * len(prompts):  # noqa: B023
                        _step_engines(adaptive)
                    return n

                pulled = eventually(pulled_now, lambda n: n >= 4 * len(prompts),  # noqa: B023
                                    timeout_s=60, interval_s=1)
                assert pulled == 4 * len(prompts)
            else:  # idle engines, relaxed SLOs: the model serves each whole
                assert set(grew) == {("whole", "whole_meets_slo")}, grew
                # the streamed answers calibrated the cost model to these engines
                scales = scrape(url)
                for part in ("prefill", "decode"):
                    scale = value(scales, "pdserve_router_path_cost_scale", part=part)
                    assert scale > 0 and scale != 1.0, (part, scale)


def test_the_decision_is_in_the_timeline_and_the_trace(adaptive: Cluster) -> None:
    rid = f"plan-{uuid.uuid4().hex}"
    body = {"model": SERVED_NAME, "prompt": "the timeline of one plan", "max_tokens": 4}
    resp = httpx.post(f"{adaptive.url}/v1/completions", json=body, timeout=60,
                      headers={"x-request-id": rid})
    assert resp.status_code == 200

    def plan_of_request() -> dict[str, Any]:
        for line in adaptive.router_timeline.read_text().splitlines():
            record = json.loads(line)
            if record["request_id"] == rid:
                return dict(record.get("plan") or {})
        return {}

    plan = eventually(plan_of_request, bool, timeout_s=10)
    assert plan["path"] == "whole" and plan["reason"] == "whole_meets_slo", plan
    assert 0 < plan["predicted_ttft_s"] < 1 and 0 < plan["predicted_tpot_s"] < 0.1, plan
    assert adaptive.traces is not None

    def root_span() -> dict[str, object]:
        for span in adaptive.traces.snapshot():  # type: ignore[union-attr]
            if span.name == "pdserve.request" and \
                    span.attributes.get("pdserve.request_id") == rid:
                return span.attributes
        return {}

    attributes = eventually(root_span, bool, timeout_s=30)
    assert attributes["pdserve.path"] == "whole", attributes
    assert attributes["pdserve.plan.reason"] == "whole_meets_slo", attributes
    assert attributes["pdserve.plan.predicted_ttft_s"] == plan["predicted_ttft_s"], attributes


async def _burst(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> list[int]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(prompt: str) -> int:
            async with sem:
                body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
                        "temperature": 0}
                return (await client.post(f"{url}/v1/completions", json=body)).status_code
        return list(await asyncio.gather(*(one(p) for p in prompts)))


def test_a_switching_load_moves_the_path_mix(adaptive: Cluster, tiny_model_dir: Path) -> None:
    """Held plans (the default): a burst of long prompts with 4-token answers holds some of
    them until the answers they would stall have ended; short prompts with long answers then
    go whole at once. No request fails."""
    long = make_prompts(tiny_model_dir, [900 + 7 * i for i in range(16)], seed=24,
                        tag="held-long")
    short = make_prompts(tiny_model_dir, [60 + 3 * i for i in range(6)], seed=25,
                         tag="held-short")
    # 25 ms TPOT (plans aim at 20): a 900-token prefill over a 4-token answer's 3 gaps puts
    # it past that, while its own answer, a few steps, keeps it
    with _router(adaptive, tpot_slo_s=0.025, ttft_slo_s=2.0) as url:
        before = _paths(url)
        codes = asyncio.run(_burst(url, long, max_tokens=4, concurrency=6))
        burst = _grew(before, _paths(url))
        middle = _paths(url)
        codes += asyncio.run(_burst(url, short, max_tokens=48, concurrency=1))
        calm = _grew(middle, _paths(url))
    assert codes == [200] * (len(long) + len(short)), codes
    assert burst.get(("whole", "held"), 0) + burst.get(("pd_first_token", "held"), 0) \
        + burst.get(("pd", "held"), 0) >= 1, burst
    assert calm == {("whole", "whole_meets_slo"): len(short)}, calm  # nothing to wait for


def test_without_holds_the_split_moves_the_path_mix(adaptive: Cluster,
                                                   tiny_model_dir: Path) -> None:
    long = make_prompts(tiny_model_dir, [900 + 7 * i for i in range(16)], seed=22,
                        tag="switch-long")
    short = make_prompts(tiny_model_dir, [60 + 3 * i for i in range(6)], seed=23,
                         tag="switch-short")
    # 15 ms TPOT: a long prefill landing on an engine stalls its 16-token answers past it,
    # while the P/D hop (50 ms over 16 tokens) does not (a 4-token answer would miss by the
    # hop alone: P/D cannot save it)
    with _router(adaptive, tpot_slo_s=0.015, ttft_slo_s=2.0, hold_prefills=False,
                 adaptive_window_s=5.0) as url:
        before = _paths(url)
        codes = asyncio.run(_burst(url, long, max_tokens=16, concurrency=6))
        burst = _grew(before, _paths(url))
        # the engines' prefill shares and the stall-sensitive demand decay (5 s window):
        # 16 sensitive requests fall under the split's 2 after 5 x ln 8 = 10.4 s
        time.sleep(13)
        middle = _paths(url)
        codes += asyncio.run(_burst(url, short, max_tokens=48, concurrency=1))
        calm = _grew(middle, _paths(url))
    assert codes == [200] * (len(long) + len(short)), codes
    pd_in_burst = sum(v for (path, _), v in burst.items() if path.startswith("pd"))
    assert pd_in_burst >= 1, burst  # long prompts, short answers: some went P/D
    assert calm == {("whole", "whole_meets_slo"): len(short)}, calm  # then all whole again
