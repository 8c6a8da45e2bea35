"""Whole-serving simulated engines behind the router's placement pool (``bench.sim.placed``):
where each policy sends requests, what the engines' prefix caches save, the engine's block
granularity, and the fidelity report's pure parts (``bench.sim_fidelity``,
``bench.routing_real``)."""

from __future__ import annotations

import pytest

from bench.routing_real import cache_stats, verdict
from bench.sim.fleet import FleetSettings
from bench.sim.placed import simulate_placed
from bench.sim.workload import SimRequest
from bench.sim_fidelity import (
    error,
    kendall_tau,
    policy_for,
    ranking,
    repeat_report,
    settled_agreement,
    settled_pairs,
    sim_summary,
)
from router.policy.context import PolicyContext
from router.policy.hashing import block_hashes
from router.policy.registry import create_prefill_policy

SETTINGS = FleetSettings(1.0, 0.05, warmup_s=0.0)  # prefill 0.01 + 1.5e-4/token, step 0.006
PER_TOKEN = SETTINGS.costs.prefill_s_per_token


def _policy(name: str):  # type: ignore[no-untyped-def]
    return create_prefill_policy(name, PolicyContext(ttft_slo_s=1.0))


def _prompt(prefix: int, n: int, tail: int) -> tuple[int, ...]:
    """Token ids: ``n`` shared tokens of prefix family ``prefix``, then ``tail`` of their own."""
    return tuple(prefix * 100_000 + i for i in range(n)) + tuple(range(7_000_000 + tail,
                                                                       7_000_000 + 2 * tail))


def _request(i: int, at_s: float, ids: tuple[int, ...], output: int = 4) -> SimRequest:
    return SimRequest(i, at_s, len(ids), output, block_hashes(ids, 16))


def test_round_robin_spreads_simultaneous_requests_a_prefix_policy_stacks() -> None:
    # two prompts of one family arriving together
    reqs = [_request(i, 0.0, _prompt(0, 512, 16 + i)) for i in range(2)]
    sizes = [r.prompt_tokens for r in reqs]
    rr = simulate_placed(reqs, 2, _policy("round_robin"), SETTINGS)
    assert rr.ttft_s == pytest.approx([SETTINGS.costs.prefill_s(t) for t in sizes])  # 1 each
    # prefix_only books the first prompt as cached on its engine and sends the second there,
    # where it waits for the first's prefill (the engine's own cache fills only when it is done)
    affine = simulate_placed(reqs, 2, _policy("prefix_only"), SETTINGS)
    assert affine.ttft_s[0] == pytest.approx(rr.ttft_s[0])
    assert affine.ttft_s[1] >= affine.ttft_s[0] + SETTINGS.costs.prefill_s(sizes[1])


def test_a_prefix_aware_policy_reuses_the_engine_cache_round_robin_misses() -> None:
    # one family three times in a row: round robin sends the second to the other engine
    reqs = [_request(i, float(i), _prompt(0, 512, 16 + i)) for i in range(3)]
    rr = simulate_placed(reqs, 2, _policy("round_robin"), SETTINGS)
    affine = simulate_placed(reqs, 2, _policy("prefix_only"), SETTINGS)
    cold = SETTINGS.costs.prefill_s(reqs[1].prompt_tokens)
    assert rr.ttft_s[1] == pytest.approx(cold)  # the other engine: nothing cached
    # prefix_only: the 512 shared tokens cached, only the request's own ones computed
    assert affine.ttft_s[1] == pytest.approx(SETTINGS.costs.prefill_s(reqs[1].prompt_tokens
                                                                      - 512))
    assert affine.ttft_s[1] < rr.ttft_s[1]


def test_engine_blocks_reuse_only_whole_blocks_of_the_cached_prefix() -> None:
    ids = tuple(range(200))  # 12 full 16-token blocks
    reqs = [_request(0, 0.0, ids), _request(1, 1.0, ids)]
    fine = simulate_placed(reqs, 2, _policy("prefix_only"), SETTINGS)
    coarse = simulate_placed(reqs, 2, _policy("prefix_only"),
                             FleetSettings(1.0, 0.05, warmup_s=0.0, engine_block_tokens=128))
    # to the token: 192 cached, 8 computed; whole 128-token blocks: 128 cached, 72 computed
    assert fine.ttft_s[1] == pytest.approx(SETTINGS.costs.prefill_s(8))
    assert coarse.ttft_s[1] == pytest.approx(SETTINGS.costs.prefill_s(72))
    assert coarse.ttft_s[1] - fine.ttft_s[1] == pytest.approx(64 * PER_TOKEN)


def test_placement_books_and_releases_every_request() -> None:
    reqs = [_request(i, i * 0.01, _prompt(i % 3, 256, 16 + i), output=8) for i in range(30)]
    res = simulate_placed(reqs, 2, _policy("dualmap"), SETTINGS)
    assert len(res.ttft_s) == 30 and sum(res.paths.values()) == 30
    assert all(t > 0 for t in res.ttft_s)


def test_sim_summary_percentiles_and_attainment() -> None:
    reqs = [_request(i, float(i), _prompt(i, 64, 16), output=3) for i in range(10)]
    res = simulate_placed(reqs, 2, _policy("round_robin"), SETTINGS)
    s = sim_summary(res, 1.0, 0.05)
    assert s["slo_attainment"] == 1.0
    assert s["ttft_p50"] == pytest.approx(SETTINGS.costs.prefill_s(80))  # all alike, idle
    assert s["tpot_p90"] == pytest.approx(0.006)
    assert sim_summary(res, 0.01, 0.05)["slo_attainment"] == 0.0  # control: a tighter SLO


def test_fidelity_helpers() -> None:
    assert error(0.2, 0.25) == pytest.approx(0.25)
    assert error(None, 1.0) is None and error(0.0, 1.0) is None
    assert policy_for("vllm-router:cache_aware") == "sglang_cache_aware"
    assert policy_for("dualmap") == "dualmap"
    assert policy_for("vllm-router:power_of_two") is None
    points = {"a": {"slo_attainment": 0.9, "ttft_p90": 0.5},
              "b": {"slo_attainment": 0.95, "ttft_p90": 0.9},
              "c": {"slo_attainment": 0.9, "ttft_p90": 0.3}}
    assert ranking(points) == ["b", "c", "a"]
    assert kendall_tau(["a", "b", "c"], ["a", "b", "c"]) == 1.0
    assert kendall_tau(["a", "b", "c"], ["c", "b", "a"]) == -1.0
    assert kendall_tau(["a"], ["a"]) is None


def test_cache_stats_and_verdict() -> None:
    before = {"w1": {"vllm:prefix_cache_hits_total": 10, "vllm:prefix_cache_queries_total": 100,
                     "vllm:prompt_tokens_total": 100},
              "w2": {"vllm:prefix_cache_hits_total": 0, "vllm:prefix_cache_queries_total": 0,
                     "vllm:prompt_tokens_total": 0}}
    after = {"w1": {"vllm:prefix_cache_hits_total": 60, "vllm:prefix_cache_queries_total": 300,
                    "vllm:prompt_tokens_total": 300},
             "w2": {"vllm:prefix_cache_hits_total": 50, "vllm:prefix_cache_queries_total": 100,
                    "vllm:prompt_tokens_total": 100}}
    stats = cache_stats(before, after)
    assert stats == {"hit_rate": pytest.approx(100 / 300), "prompt_tokens": [200, 100]}
    base = {"trace": "t", "rate": 2.0}
    ours = {**base, "router": "dualmap", "hit_rate": 0.3, "ttft_p99": 1.0, "slo_attainment": 0.95}
    worse = {**base, "router": "x", "hit_rate": 0.2, "ttft_p99": 1.5, "slo_attainment": 0.9}
    assert "ahead of or equal" in verdict([ours, worse])[0]
    better = {**worse, "router": "y", "ttft_p99": 0.5}  # control: a faster tail
    assert "behind" in verdict([ours, worse, better])[0] and "y" in verdict([ours, better])[0]


def test_contention_slows_the_simulated_engines_by_the_fitted_factor() -> None:
    from bench.sim_fidelity import Point, simulate_point, slowdown
    from router.autoscale.profile import InstanceProfile

    reqs = [_request(i, float(i), _prompt(i, 256, 16), output=4) for i in range(5)]
    point = Point("t", 1.0, "round_robin", "round_robin", reqs, {}, (1.0, 0.05))
    assert point.load_ktok_s == pytest.approx(sum(r.prompt_tokens for r in reqs) / 4 / 1000)
    assert slowdown(1.5, 0.1, point) == pytest.approx(1.5 + 0.1 * point.load_ktok_s)
    profile = InstanceProfile()
    alone = simulate_point(point, profile, SETTINGS, 1.0)
    slowed = simulate_point(point, profile, SETTINGS, 2.0)
    # every request runs alone: twice the profile's times is twice the TTFT and TPOT
    assert slowed["ttft_p50"] == pytest.approx(2 * alone["ttft_p50"])
    assert slowed["tpot_p50"] == pytest.approx(2 * alone["tpot_p50"])


def test_vllm_router_decisions_are_summed_by_outcome() -> None:
    from bench.routing_real import decision_counts

    text = (
        "# TYPE vllm_router_prefix_routing_decisions_total counter\n"
        'vllm_router_prefix_routing_decisions_total{policy="cache_aware",stage="regular",'
        'outcome="prefix_hit"} 60\n'
        'vllm_router_prefix_routing_decisions_total{policy="cache_aware",stage="pd",'
        'outcome="prefix_hit"} 5\n'
        'vllm_router_prefix_routing_decisions_total{policy="cache_aware",stage="regular",'
        'outcome="missing_tokens"} 3\n'
        "# TYPE vllm_router_processed_requests_total counter\n"
        'vllm_router_processed_requests_total{worker="http://w1"} 68\n')
    assert decision_counts(text) == {"prefix_hit": 65.0, "missing_tokens": 3.0}
    assert decision_counts("# TYPE other counter\nother_total 4\n") == {}  # control
    pdserve = ("# TYPE pdserve_router_routing_decisions_total counter\n"
               'pdserve_router_routing_decisions_total{role="aggregated",'
               'reason="cache_affinity"} 40\n'
               'pdserve_router_routing_decisions_total{role="aggregated",reason="slo_switch"} 2\n'
               'pdserve_router_routing_decisions_total{role="decode",reason="slo_switch"} 1\n')
    assert decision_counts(pdserve) == {"cache_affinity": 40.0, "slo_switch": 3.0}


def test_rounds_are_averaged_per_router_and_judged_on_the_means() -> None:
    from bench.routing_real import aggregate, format_mean_row

    def point(router: str, hit: float, p99: float, att: float | None) -> dict[str, object]:
        return {"trace": "t", "rate": 6.0, "router": router, "hit_rate": hit, "ttft_p50": 0.2,
                "ttft_p99": p99, "slo_attainment": att}

    rounds = [point("dualmap", 0.30, 1.0, 0.95), point("x", 0.32, 1.4, 0.90),
              point("dualmap", 0.34, 1.2, None), point("x", 0.30, 1.0, 0.96)]
    means = aggregate(rounds)
    dm, x = means
    assert (dm["router"], dm["runs"]) == ("dualmap", 2)
    assert dm["hit_rate"] == pytest.approx(0.32) and dm["hit_rate_range"] == (0.30, 0.34)
    assert dm["slo_attainment"] == 0.95 and dm["slo_attainment_range"] == (0.95, 0.95)
    assert x["ttft_p99"] == pytest.approx(1.2)
    assert "ahead of or equal" in verdict(means)[0]  # equal hits and p99, better attainment
    assert "behind x" in verdict([dm, {**x, "slo_attainment": 0.99}])[0]  # control
    assert format_mean_row(dm) == ("| t | 6 | dualmap | 2 | 32.0% (30.0%-34.0%) | 200 (200-200) "
                                   "| 1,100 (1,000-1,200) | 0.950 (0.950-0.950) |")


def _pt(router: str, att: float, p90: float, rate: float = 2.0) -> dict[str, object]:
    return {"trace": "api", "rate": rate, "router": router, "slo_attainment": att,
            "ttft_p90": p90}


def test_settled_pairs_keep_only_what_both_real_runs_order_alike() -> None:
    first = [_pt("a", 1.0, 0.1), _pt("b", 0.9, 0.2), _pt("c", 0.8, 0.3)]
    second = [_pt("a", 1.0, 0.1), _pt("b", 0.7, 0.2), _pt("c", 0.8, 0.3)]  # b and c swap
    settled = settled_pairs(first, second)
    assert settled == {("api", 2.0): [("a", "b"), ("a", "c")]}
    assert "Kendall tau +0.33" in repeat_report(first, second)[0]
    # control: a run against itself settles every pair
    assert len(settled_pairs(first, first)[("api", 2.0)]) == 3
    rows = [{"trace": "api", "rate": 2.0, "router": r, "sim": s}
            for r, s in (("a", {"slo_attainment": 0.95, "ttft_p90": 0.1}),
                         ("b", {"slo_attainment": 0.99, "ttft_p90": 0.1}),
                         ("c", {"slo_attainment": 0.90, "ttft_p90": 0.1}))]
    # the simulator puts b above a (wrong on a settled pair) and a above c (right); b-c unsettled
    assert settled_agreement(rows, settled) == (1, 2)
