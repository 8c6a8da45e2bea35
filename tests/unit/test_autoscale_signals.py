"""Two metric snapshots -> one planner Observation, against hand-computed numbers."""

from __future__ import annotations

import pytest

from router.autoscale.signals import Snapshot, observe, quantile

INF = float("inf")


def _sample(name: str, value: float, **labels: str
            ) -> tuple[tuple[str, frozenset[tuple[str, str]]], float]:
    return (name, frozenset(labels.items())), value


def _prefill(compute: float, hit: float, prompt_le: dict[float, float]) -> dict:
    out = dict([_sample("vllm:prompt_tokens_by_source_total", compute, source="local_compute"),
                _sample("vllm:prompt_tokens_by_source_total", hit, source="local_cache_hit"),
                _sample("vllm:request_prompt_tokens_count", prompt_le.get(INF, 0))])
    for le, count in prompt_le.items():
        out.update([_sample("vllm:request_prompt_tokens_bucket", count, le=str(le))])
    return out


def _router(ok: float, ttft_le: dict[float, float]) -> dict:
    out = dict([_sample("pdserve_router_requests_received_total", ok)])
    for le, count in ttft_le.items():
        out.update([_sample("pdserve_router_ttft_seconds_bucket", count, le=str(le))])
    return out


def _decode(gen: float, finished: float, waiting: float = 0.0) -> dict:
    return dict([_sample("vllm:request_generation_tokens_sum", gen),
                 _sample("vllm:request_generation_tokens_count", finished),
                 _sample("vllm:num_requests_waiting", waiting, engine="0")])


def test_observation_from_two_snapshots() -> None:
    before = Snapshot(100.0, _router(10, {0.5: 10, 1.0: 10, INF: 10}),
                      {"p0": _prefill(1000, 0, {1000: 10, 4000: 10, INF: 10})},
                      {"d0": _decode(500, 5)})
    # 10 s later: 20 more requests; 20 prefilled, 6000 tokens computed and 2000 served from the
    # cache, 18 prompts under 1000 tokens, 2 up to 4000; 18 TTFTs under 0.5 s, 2 up to 1 s;
    # 20 decodes finished with 2000 tokens
    after = Snapshot(110.0, _router(30, {0.5: 28, 1.0: 30, INF: 30}),
                     {"p0": _prefill(7000, 2000, {1000: 28, 4000: 30, INF: 30}),
                      "p1": _prefill(99, 99, {})},  # joined in between: ignored
                     {"d0": _decode(2500, 25, waiting=3), "d1": _decode(0, 0, waiting=1)})
    obs = observe(before, after)
    assert (obs.interval_s, obs.arrivals) == (10.0, 20)
    assert (obs.mean_isl, obs.mean_osl) == (300.0, 100.0)
    # p90 rank 18 of 20 falls at the 1000-token bucket's top; 6000 of 8000 tokens uncached
    assert obs.p90_isl == pytest.approx(1000 * 0.75)
    assert obs.ttft_p90_s == pytest.approx(0.5)
    assert (obs.prefill_replicas, obs.decode_replicas) == (2, 2)
    # queues: the gauge at the end, every worker scraped then (the prefill ones export none)
    assert (obs.prefill_queued, obs.decode_queued) == (0.0, 4.0)


def test_quantile_interpolates_within_a_bucket() -> None:
    assert quantile([(1.0, 5), (2.0, 15), (INF, 15)], 0.5) == pytest.approx(1.25)
    assert quantile([(1.0, 0), (INF, 0)], 0.9) is None
