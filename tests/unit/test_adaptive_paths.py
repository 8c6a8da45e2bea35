"""The adaptive path decision on hand-made states: one test per reason, each with its control."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from router.errors import ConfigError
from router.policy.adaptive import REASONS, AdaptivePaths
from router.policy.base import Candidate, RouteRequest
from router.policy.hashing import block_hashes
from router.policy.path_cost import (
    EngineLoad,
    PathCosts,
    estimate_pd,
    estimate_whole,
    poisson_quantile,
    poisson_tail,
)

COSTS = PathCosts(prefill_s_per_token=1e-4, prefill_fixed_s=0.0, decode_step_s=0.01,
                  decode_step_s_per_seq=0.001, hop_s=0.02, pull_s_per_token=0.0)


def _request(tokens: int = 1000, rid: str = "r") -> RouteRequest:
    ids = tuple(range(tokens))
    return RouteRequest(request_id=rid, model="m", prompt_token_ids=ids,
                        block_hashes=block_hashes(ids))


def _paths(ttft: float = 1.0, tpot: float = 0.05) -> AdaptivePaths:
    return AdaptivePaths(COSTS, ttft, tpot)


def test_whole_on_an_idle_engine_meets_the_slos() -> None:
    engines = [EngineLoad("a"), EngineLoad("b")]
    decision = _paths().decide(_request(), 64, engines)
    assert decision is not None
    assert decision.plan.path == "whole" and decision.reason == "whole_meets_slo"
    assert decision.plan.ttft_s == pytest.approx(0.1)
    assert decision.other is not None and decision.other.path == "pd"


def test_a_long_queue_everywhere_but_one_prefiller_sends_the_prompt_there_for_pd() -> None:
    # a and b decode and are queued just past the TTFT SLO for a whole plan; c is idle but
    # cannot serve whole: prefilled there, the decode starts when a or b's queue ends (0.95 s)
    engines = [EngineLoad("a", queued_s=0.95, running=1), EngineLoad("b", queued_s=0.95),
               EngineLoad("c", whole=False, decode=False)]
    decision = _paths().decide(_request(), 64, engines)
    assert decision is not None
    assert (decision.plan.path, decision.plan.prefill_worker) == ("pd", "c")
    assert decision.plan.ttft_s == pytest.approx(0.95 + 0.02)  # the decoder's queue, the hop
    assert decision.reason == "whole_misses_ttft"
    # control: without the queues the same fleet serves it whole
    calm = [EngineLoad("a", running=1), EngineLoad("b"), EngineLoad("c", whole=False,
                                                                    decode=False)]
    assert _paths().decide(_request(), 64, calm).reason == "whole_meets_slo"  # type: ignore


def test_prefill_on_a_busy_decoder_would_harm_its_admitted_requests() -> None:
    # 2,000-token prompt = 0.2 s of prefill; the 8-token answers already decoding on a and b
    # would get 25 ms more per token: past the 30 ms TPOT SLO. c only prefills.
    engines = [EngineLoad("a", running=4, admitted_output_tokens=8),
               EngineLoad("b", running=4, admitted_output_tokens=8),
               EngineLoad("c", whole=False, decode=False)]
    decision = _paths(tpot=0.03).decide(_request(2000), 8, engines)
    assert decision is not None
    assert decision.plan.path == "pd" and decision.plan.prefill_worker == "c"
    assert decision.reason == "whole_harms_admitted"
    # control: long answers on the decoders amortise the stall, whole is fine
    patient = [EngineLoad("a", running=4, admitted_output_tokens=256),
               EngineLoad("b", running=4, admitted_output_tokens=256),
               EngineLoad("c", whole=False, decode=False)]
    assert _paths(tpot=0.03).decide(_request(2000), 8, patient).reason == "whole_meets_slo"  # type: ignore


def test_a_stall_sensitive_request_is_decoded_where_no_prefill_runs() -> None:
    # 5 prefills/s of 0.2 s each on a and b: a 16-token answer decoding there for ~0.16 s
    # catches 2 of them in the 90th percentile, 25 ms per token more: past a 30 ms SLO
    busy = {"prefill_rate": 5.0, "mean_prefill_s": 0.2}
    engines = [EngineLoad("a", **busy), EngineLoad("b", **busy),  # type: ignore[arg-type]
               EngineLoad("d", whole=False, prefill=False)]
    decision = _paths(tpot=0.03).decide(_request(100), 16, engines)
    assert decision is not None
    assert decision.plan.path == "pd" and decision.plan.worker == "d"
    assert decision.reason == "stall_sensitive" and decision.sensitive
    assert decision.plan.tpot_s < 0.03 < decision.other.tpot_s  # type: ignore[union-attr]
    # control: with no prefills landing there the same request is served whole
    calm = [EngineLoad("a"), EngineLoad("b"), EngineLoad("d", whole=False, prefill=False)]
    assert _paths(tpot=0.03).decide(_request(100), 16, calm).reason == "whole_meets_slo"  # type: ignore
    # and a long answer amortises the same prefills: whole again
    assert _paths(tpot=0.03).decide(_request(100), 512, engines).reason == "whole_meets_slo"  # type: ignore


def test_the_wait_for_its_own_prefill_is_exposure_to_prefills() -> None:
    """Prefills sent to an engine while a request waits there run after its own, between its
    decode steps: a 12-token answer queued 1 s behind others catches ~1.3 prefills of 0.2 s
    (3 at the 0.95-quantile, 18 ms a token each), past a 40 ms target, where its answer alone
    (0.11 s, one landing) stays under it."""
    paths = _paths(tpot=0.05)
    busy = {"prefill_rate": 1.0, "mean_prefill_s": 0.2}
    queued = [EngineLoad("a", queued_s=1.0, **busy), EngineLoad("b", queued_s=1.0, **busy),  # type: ignore[arg-type]
              EngineLoad("d", whole=False, prefill=False)]
    request = _request(1500)
    assert paths.stall_sensitive(request, 12, queued)
    decision = paths.decide(request, 12, queued)
    assert decision is not None and decision.reason == "stall_sensitive" and decision.sensitive
    assert decision.plan.worker == "d"
    # control: the same rates with nothing queued ahead (a 0.15 s wait, one landing)
    calm = [EngineLoad("a", **busy), EngineLoad("b", **busy),  # type: ignore[arg-type]
            EngineLoad("d", whole=False, prefill=False)]
    assert not paths.stall_sensitive(request, 12, calm)
    # a 4,000-token prompt waits 0.1 s in the queue and 0.4 s for its own prefill: exposed
    # (2 landings at p95); control: the same prompt cached where it would be served (a
    # conversation turn) computes nothing, and the queue alone exposes it to one
    def fleet(cached_tokens: int) -> list[EngineLoad]:
        return [EngineLoad("a", queued_s=0.1, cached_tokens=cached_tokens, **busy),  # type: ignore[arg-type]
                EngineLoad("b", queued_s=0.1, **busy),  # type: ignore[arg-type]
                EngineLoad("d", whole=False, prefill=False)]

    assert paths.stall_sensitive(_request(4000), 12, fleet(0))
    assert not paths.stall_sensitive(_request(4000), 12, fleet(4000))


def test_a_few_sensitive_requests_among_many_keep_no_decoder_quiet() -> None:
    """The split sends every request P/D while it holds: 4 stall-sensitive requests in 40 (a
    tenth, under a quarter: half an engine of two) reserve no decoder, though their demand
    alone would."""
    cands = [("flex", Candidate(w)) for w in ("a", "b")]
    request = _request(1500, "next")
    other = estimate_whole(COSTS, 150, 160, EngineLoad("b"))
    paths = _paths(tpot=0.025)
    for i in range(36):
        paths.dispatched(_request(150, f"o{i}"), other, 160, now_s=i * 0.1)
    _split_of_two(paths, [0.5, 1.5, 2.5, 3.5])
    assert paths.quiet_decoders_needed(3.5) == 1
    assert 0.05 < paths.sensitive_share(3.5) < 0.25  # a tenth, the later ones weigh more
    paths.loads(request, cands, 3.5)
    assert paths.reserved == ()
    # control: the same four with no other traffic reserve one
    alone = _paths(tpot=0.025)
    _split_of_two(alone, [0.5, 1.5, 2.5, 3.5])
    alone.loads(request, cands, 3.5)
    assert alone.reserved == ("a",)


def test_with_no_quiet_decoder_a_stall_sensitive_request_is_planned_as_any_other() -> None:
    """Two flex engines, neither reserved: P/D would decode it on the other engine that
    prefills as much, so it is planned as any request and only counted as sensitive (its
    demand is what reserves a quiet decoder)."""
    busy = {"prefill_rate": 5.0, "mean_prefill_s": 0.2}
    engines = [EngineLoad("a", **busy), EngineLoad("b", **busy)]  # type: ignore[arg-type]
    paths = _paths(tpot=0.03)
    assert paths.stall_sensitive(_request(1000), 16, engines)
    decision = paths.decide(_request(1000), 16, engines)
    assert decision is not None and decision.sensitive
    assert decision.reason != "stall_sensitive"
    # control: the same fleet with b reserved decodes it there, P/D
    quiet = [EngineLoad("a", **busy), EngineLoad("b", reserved=True)]  # type: ignore[arg-type]
    held = paths.decide(_request(1000), 16, quiet)
    assert held is not None and held.reason == "stall_sensitive" and held.sensitive
    assert (held.plan.path, held.plan.worker) == ("pd", "b")


def test_nothing_meets_the_slos_takes_the_least_bad_plan() -> None:
    engines = [EngineLoad("a", queued_s=5.0), EngineLoad("b", queued_s=9.0)]
    decision = _paths().decide(_request(), 64, engines)
    assert decision is not None and decision.reason == "best_effort"
    assert (decision.plan.path, decision.plan.worker) == ("whole", "a")  # the shorter queue
    assert decision.plan.badness(1.0, 0.05) <= decision.other.badness(1.0, 0.05)  # type: ignore


def test_a_stall_the_quantile_rounds_away_is_priced_as_a_risk() -> None:
    # A 5-token answer on an engine given 2.5 prefills/s of 0.3 s: the 4 steps of 10 ms after
    # its first token expect 0.1 landings, so the 0.9-quantile is none (a bare step), yet one
    # answer in ten catches a landing, 75 ms more over each of its 4 token gaps: past a 40 ms
    # target.
    plan = estimate_whole(COSTS, 100, 5, EngineLoad("a", prefill_rate=2.5, mean_prefill_s=0.3))
    assert plan.landings_mean == pytest.approx(0.1)
    assert poisson_quantile(plan.landings_mean, 0.9) == 0
    assert plan.tpot_miss_probability(0.04) == pytest.approx(1 - math.exp(-0.1))
    assert plan.expected_misses(1.0, 0.04) == pytest.approx(1 - math.exp(-0.1))
    assert not plan.meets(1.0, 0.04)  # 9.5 % risk: over the 5 % a plan may take
    # control: the same answer where no prefill lands has no risk and meets
    calm = estimate_whole(COSTS, 100, 5, EngineLoad("b"))
    assert calm.tpot_miss_probability(0.04) == 0.0 and calm.meets(1.0, 0.04)
    # a plan past the target with no landing misses for certain; two landings needed: tail >= 2
    assert estimate_whole(COSTS, 100, 5, EngineLoad("c", running=40)).tpot_miss_probability(
        0.04) == 1.0
    assert poisson_tail(0.4, 2) == pytest.approx(1 - math.exp(-0.4) * 1.4)
    assert poisson_tail(0.4, 0) == 1.0 and poisson_tail(0.0, 1) == 0.0


def test_of_two_engines_that_meet_the_slos_the_lower_stall_risk_serves_whole() -> None:
    # a 4-token answer: 5 % risk of a landing on a (1.25 prefills/s), 1 % on b (0.25/s); both
    # within the quantile, so their predicted TPOTs tie (a bare step)
    risky, safe = {"prefill_rate": 1.25, "mean_prefill_s": 0.3}, \
        {"prefill_rate": 0.25, "mean_prefill_s": 0.3}
    engines = [EngineLoad("a", **risky), EngineLoad("b", **safe)]  # type: ignore[arg-type]
    decision = _paths().decide(_request(100), 4, engines)
    assert decision is not None and decision.reason == "whole_meets_slo"
    assert decision.plan.worker == "b"
    # control: the loads swapped, the choice follows the risk, not the name
    swapped = [EngineLoad("a", **safe), EngineLoad("b", **risky)]  # type: ignore[arg-type]
    assert _paths().decide(_request(100), 4, swapped).plan.worker == "a"  # type: ignore


def test_when_every_plan_misses_the_one_with_fewest_expected_misses_is_taken() -> None:
    # whole-only engines: a's queue misses the TTFT for certain (1.6 s, 1.6x the SLO); b's
    # prefill landings put a 5-token answer's tail TPOT at 4x the target but miss only 33 % of
    # the time
    engines = [EngineLoad("a", whole=True, prefill=False, decode=False, queued_s=1.5),
               EngineLoad("b", whole=True, prefill=False, decode=False, prefill_rate=10.0,
                          mean_prefill_s=0.3)]
    decision = _paths().decide(_request(), 5, engines)
    assert decision is not None and decision.plan.worker == "b"
    assert decision.plan.expected_misses(1.0, 0.04) == pytest.approx(1 - math.exp(-0.4))
    # control: by the worst SLO ratio alone a would have been the pick
    plans = [estimate_whole(COSTS, 1000, 5, e) for e in engines]
    assert min(plans, key=lambda p: p.badness(1.0, 0.04)).worker == "a"


def test_forcing_a_path_and_a_fleet_with_no_pair() -> None:
    engines = [EngineLoad("a"), EngineLoad("b")]
    forced = _paths().decide(_request(), 64, engines, force="pd")
    assert forced is not None and forced.plan.path == "pd" and forced.reason == "forced"
    lone = _paths().decide(_request(), 64, [EngineLoad("a")], force="pd")
    assert lone is not None and lone.plan.path == "whole" and lone.reason == "no_pd_pair"
    assert _paths().decide(_request(), 64, []) is None


def test_cool_down_engines_are_planned_only_when_nothing_else_can() -> None:
    engines = [EngineLoad("a", recently_failed=True), EngineLoad("b", queued_s=0.5)]
    decision = _paths().decide(_request(), 64, engines)
    assert decision is not None and decision.plan.worker == "b"
    only = _paths().decide(_request(), 64, [EngineLoad("a", recently_failed=True)])
    assert only is not None and only.plan.worker == "a"


def test_every_reason_is_a_known_label() -> None:
    assert set(REASONS) >= {"whole_meets_slo", "whole_misses_ttft", "whole_misses_tpot",
                            "whole_harms_admitted", "best_effort", "forced", "no_pd_pair"}


def test_dispatches_build_queues_shares_and_caches_and_finishes_release_them() -> None:
    paths = _paths()
    request = _request(1000, "r1")
    cands = [("flex", Candidate("a")), ("flex", Candidate("b"))]
    first = paths.decide(request, 64, paths.loads(request, cands, 0.0))
    assert first is not None
    paths.dispatched(request, first.plan, 64, now_s=0.0)
    loads = {e.worker_id: e for e in paths.loads(request, cands, 0.05)}
    chosen = loads[first.plan.worker]
    assert chosen.queued_s == pytest.approx(0.05)  # 0.1 s of prefill, 0.05 s later
    assert chosen.running == 1 and chosen.mean_prefill_s == pytest.approx(0.1)
    assert chosen.prefill_rate == pytest.approx(0.1, rel=0.01)  # one prefill, 10 s window
    assert chosen.cached_tokens == 992  # whole 16-token blocks of the prompt
    other = next(e for e in loads.values() if e is not chosen)
    assert (other.queued_s, other.running, other.cached_tokens) == (0.0, 0, 0)
    # the same prompt again goes where it is cached
    again = paths.decide(request, 64, list(loads.values()))
    assert again is not None and again.plan.worker == first.plan.worker
    # a second prompt prefilled there stalls r1 (64 tokens, 63 gaps) by its 0.1 s
    second = _request(1000, "r2")
    paths.dispatched(second, estimate_whole(COSTS, 1000, 8, EngineLoad(chosen.worker_id)), 8,
                     now_s=0.06)
    after = {e.worker_id: e for e in paths.loads(request, cands, 0.07)}[first.plan.worker]
    assert after.admitted_stall_s == pytest.approx(0.1 / 63)
    assert after.admitted_output_tokens == 8 and after.running == 2
    paths.finished("r2")
    paths.finished("r1")
    assert paths.loads(request, cands, 100.0)[0].running == 0
    assert max(e.prefill_rate for e in paths.loads(request, cands, 100.0)) < 1e-5
    paths.retain(["b"])
    assert all(e.cached_tokens == 0 for e in paths.loads(request, [("flex", Candidate("a"))],
                                                          0.0))


def test_roles_limit_what_a_plan_may_use() -> None:
    paths = _paths()
    request = _request()
    cands = [("prefill", Candidate("p")), ("decode", Candidate("d")),
             ("aggregated", Candidate("g"))]
    loads = {e.worker_id: e for e in paths.loads(request, cands, 0.0)}
    assert (loads["p"].whole, loads["p"].prefill, loads["p"].decode) == (False, True, False)
    assert (loads["d"].whole, loads["d"].prefill, loads["d"].decode) == (True, False, True)
    assert (loads["g"].whole, loads["g"].prefill, loads["g"].decode) == (True, False, False)
    whole, pd = paths.plans(request, 64, list(loads.values()))
    assert {p.worker for p in whole} == {"d", "g"}
    assert {(p.prefill_worker, p.worker) for p in pd} == {("p", "d")}


def test_estimates_follow_the_formulas() -> None:
    engine = EngineLoad("a", queued_s=0.3, running=3, prefill_rate=2.0, mean_prefill_s=0.1,
                        cached_tokens=200, admitted_output_tokens=40, admitted_stall_s=0.002)
    whole = estimate_whole(COSTS, 1000, 50, engine)
    assert whole.ttft_s == pytest.approx(0.3 + 800 * 1e-4)
    step = 0.01 + 3 * 0.001
    # Poisson(2/s x 49 gaps x 13 ms = 1.27): 95th percentile 3 prefills of 0.1 s over 49 gaps
    assert poisson_quantile(2.0 * 49 * step) == 3
    assert whole.tpot_s == pytest.approx(step + 3 * 0.1 / 49)
    assert whole.harm_tpot_s == pytest.approx(step + 0.002 + 0.08 / 39)
    assert poisson_quantile(0.0) == 0 and poisson_quantile(0.05) == 0
    assert poisson_quantile(0.2) == 1
    pd = estimate_pd(COSTS, 1000, 50, EngineLoad("p"), EngineLoad("d"))
    assert pd.ttft_s == pytest.approx(0.1 + 0.02)
    assert pd.tpot_s == pytest.approx(0.01 + 0.02 / 49)
    assert pd.harm_tpot_s == 0.0  # nothing decodes on either engine


def test_costs_from_a_profile(tmp_path: Path) -> None:
    # the file `pdserve bench profile` writes
    profile = {"prefill": {"fixed_s": 0.02, "per_token_s": 2e-4},
               "decode": {"points": [{"batch_size": 1, "step_s": 0.005},
                                     {"batch_size": 9, "step_s": 0.013}]}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    costs = PathCosts.from_file(path, hop_s=0.05)
    assert costs.prefill_s_per_token == pytest.approx(2e-4)
    assert costs.prefill_fixed_s == pytest.approx(0.02)
    assert costs.decode_step_s == pytest.approx(0.005)
    assert costs.decode_step_s_per_seq == pytest.approx(0.001)
    assert costs.hop_s == 0.05
    with pytest.raises(ConfigError):
        PathCosts.from_file(tmp_path / "missing.json")
    with pytest.raises(ConfigError):
        PathCosts(prefill_s_per_token=0)


def test_costs_are_learned_from_what_served_requests_showed() -> None:
    paths = _paths()
    for _ in range(60):  # the engines are twice as slow to prefill as assumed, decode as fast
        plan = estimate_whole(paths.costs, 1000, 64, EngineLoad("a"))
        paths.learn(plan.ttft_s, 0.2, plan.tpot_s, 0.01)
    assert paths.prefill_scale == pytest.approx(2.0, rel=0.05)
    assert paths.decode_scale == pytest.approx(1.0)
    assert paths.costs.prefill_s_per_token == pytest.approx(2e-4, rel=0.05)
    assert paths.costs.decode_step_s == pytest.approx(0.01)
    # the calibrated model predicts what was observed
    assert estimate_whole(paths.costs, 1000, 64, EngineLoad("a")).ttft_s == pytest.approx(
        0.2, rel=0.05)
    # controls: no measurement, or a prediction too short to trust, teaches nothing
    before = (paths.prefill_scale, paths.decode_scale)
    paths.learn(0.2, None, 0.01, None)
    paths.learn(0.001, 0.5, 0.0005, 0.5)
    assert (paths.prefill_scale, paths.decode_scale) == before
    # one absurd outlier moves the scale by at most 4 ** 0.1
    paths.learn(0.2, 1000.0, 0.01, 0.01)
    assert paths.prefill_scale <= before[0] * 4 ** 0.1 + 1e-9


def _learn_delayed(paths: AdaptivePaths, truth: float, delay: int, planned: bool,
                   n: int = 200) -> list[float]:
    """Each request planned now and learned ``delay`` requests later (as an answer ends
    seconds after its plan, while others end), on engines ``truth`` x slower to decode than
    the model's defaults; the decode scale after every request."""
    in_flight: list[tuple[float, float]] = []  # (predicted base TPOT, decode scale then)
    scales = []
    for _ in range(n):
        plan = estimate_whole(paths.costs, 100, 64, EngineLoad("a"))
        in_flight.append((plan.tpot_base_s, paths.decode_scale))
        if len(in_flight) > delay:
            base, scale = in_flight.pop(0)
            observed = base / scale * truth  # what an engine of that speed showed
            paths.learn(0.1, 0.1, base, observed,
                        planned_scales=(1.0, scale) if planned else None)
        scales.append(paths.decode_scale)
    return scales


def test_a_late_answer_teaches_the_scale_it_was_planned_with() -> None:
    # the engines decode 2x slower than assumed; answers end 30 requests after their plans
    fixed = _learn_delayed(_paths(), 2.0, 30, planned=True)
    assert max(fixed) <= 2.0 + 1e-9  # it approaches the truth from below, no overshoot
    assert fixed[-1] == pytest.approx(2.0, rel=0.02)
    # control: each late ratio applied to the scale others have already moved counts their
    # correction again; the scale overshoots the truth and keeps swinging around it
    late = _learn_delayed(_paths(), 2.0, 30, planned=False)
    assert max(late) > 3.0
    assert max(late[-60:]) / min(late[-60:]) > 1.5
    # with no delay, both agree
    assert _learn_delayed(_paths(), 2.0, 0, planned=True) == pytest.approx(
        _learn_delayed(_paths(), 2.0, 0, planned=False))


def test_a_heard_prefill_end_resets_its_engine_queue() -> None:
    paths = _paths()
    cands = [("flex", Candidate("a")), ("flex", Candidate("b"))]
    for rid in ("r1", "r2", "r3"):  # 0.1 s of prefill each, queued on a: it ends at 0.3
        paths.dispatched(_request(1000, rid), estimate_whole(COSTS, 1000, 64, EngineLoad("a")),
                         64, now_s=0.0)

    def load(worker: str, now: float) -> EngineLoad:
        return {e.worker_id: e for e in paths.loads(_request(10), cands, now)}[worker]

    assert load("a", 0.05).queued_s == pytest.approx(0.25)  # control: nothing heard yet
    paths.prefilled("r1", 0.05)  # r1 ended 0.05 s early: r2 and r3 start that much earlier
    assert load("a", 0.05).queued_s == pytest.approx(0.2)
    assert load("a", 0.05).admitted[0][2] == 0.0  # r1 decodes from now on
    assert load("a", 0.05).admitted[1][2] == pytest.approx(0.1)  # r2's prefill ends at 0.15
    paths.prefilled("r2", 0.4)  # r2 ended 0.25 s late: r3 is that much later
    assert load("a", 0.4).queued_s == pytest.approx(0.1)
    assert load("b", 0.4).queued_s == 0.0  # another engine's queue is its own
    before = load("a", 0.4)
    paths.prefilled("r2", 0.45)  # heard once: a second word and an unknown id change nothing
    paths.prefilled("unknown", 0.45)
    assert load("a", 0.4) == before
    paths.prefilled("r3", 0.42)  # the last one ends: the engine is idle
    assert load("a", 0.42).queued_s == 0.0


def test_the_prefill_scale_learns_only_from_requests_that_did_not_wait() -> None:
    paths = _paths()
    for _ in range(30):  # a burst: the queue's prediction was long, the prefill was not slow
        paths.learn(2.0, 0.7, 0.02, 0.02, predicted_wait_s=1.9)
    assert paths.prefill_scale == 1.0
    for _ in range(30):  # control: a request predicted to wait little teaches the scale
        paths.learn(0.1, 0.2, 0.02, 0.02, predicted_wait_s=0.01)
    assert paths.prefill_scale > 1.5


def test_the_decode_scale_learns_the_step_from_tpots_less_the_stalls_added() -> None:
    # 20-token answers on engine a; of 100, 26 had one neighbour's 0.4 s prefill land during
    # their decode and 6 two (the router dispatched them there, so it knows), the rest none
    landed = [2] * 6 + [1] * 26 + [0] * 68
    random.Random(0).shuffle(landed)
    paths, control = _paths(), _paths()
    step = COSTS.step_s(1)
    for i, k in enumerate(landed):
        rid = f"r{i}"
        for policy in (paths, control):
            policy.dispatched(_request(100, rid), estimate_whole(policy.costs, 100, 20,
                                                                  EngineLoad("a")), 20, i)
            for n in range(k):  # a neighbour's 4,000-token prefill lands while it decodes
                policy.dispatched(_request(4000, f"{rid}-{n}"),
                                  estimate_whole(policy.costs, 4000, 1, EngineLoad("a")), 1,
                                  i + 0.02)
        observed = step + k * 0.4 / 19
        assert paths.stall_added_s(rid) == pytest.approx(k * 0.4 / 19, rel=0.2)
        base = estimate_whole(paths.costs, 100, 20, EngineLoad("a")).tpot_base_s
        paths.learn(0.1, 0.1, base, observed - paths.stall_added_s(rid))
        control.learn(0.1, 0.1, estimate_whole(control.costs, 100, 20,
                                               EngineLoad("a")).tpot_base_s, observed)
        for policy in (paths, control):
            for done in [rid] + [f"{rid}-{n}" for n in range(k)]:
                policy.finished(done)
    assert paths.decode_scale == pytest.approx(1.0, abs=0.05)  # the model's step is the step
    assert control.decode_scale > 1.15  # control: their stall taught as a slower step (1.25)
    assert paths.stall_added_s("unknown") == 0.0


def test_the_split_keeps_quiet_decoders_for_stall_sensitive_demand() -> None:
    paths = _paths(tpot=0.05)
    cands = [("flex", Candidate(w)) for w in ("a", "b", "c", "d")]
    request = _request(1500, "long")
    assert paths.quiet_decoders_needed(0.0) == 0
    paths.loads(request, cands, 0.0)
    assert paths.reserved == ()  # control: no sensitive demand, no reserved engine
    for i in range(40):  # long prompts with 8-token answers on b: it prefills a lot
        rid = _request(1500, f"s{i}")
        paths.dispatched(rid, estimate_whole(COSTS, 1500, 8, EngineLoad("b")), 8, now_s=i * 0.1,
                         sensitive=True)
    assert paths.quiet_decoders_needed(4.0) == 1
    loads = {e.worker_id: e for e in paths.loads(request, cands, 4.0)}
    assert paths.reserved == ("a",)  # the quietest (b prefilled), the first by name of a/c/d
    assert loads["a"].reserved and not loads["b"].reserved
    whole, pd = paths.plans(request, 256, list(loads.values()))
    assert "a" not in {p.worker for p in whole}  # no prefill lands on the quiet decoder
    assert "a" not in {p.prefill_worker for p in pd}
    # the demand decays: a minute later the engine is open again
    paths.loads(request, cands, 64.0)
    assert paths.reserved == ()


def test_a_few_short_stall_sensitive_answers_keep_one_decoder_quiet() -> None:
    """Isolation, not token demand: 12-token answers behind long prompts at ~1 req/s ask for
    a few tokens a second, far under one decoder's capacity, yet need a decoder that
    prefills nothing (counting tokens alone kept none)."""
    paths = _paths(tpot=0.025)
    cands = [("flex", Candidate(w)) for w in ("a", "b")]
    request = _request(1500, "next")
    one = estimate_whole(COSTS, 1500, 12, EngineLoad("b"))
    paths.dispatched(_request(1500, "s0"), one, 12, now_s=0.0, sensitive=True)
    # control: one such request is not a demand (under MIN_SENSITIVE_REQUESTS)
    assert paths.quiet_decoders_needed(0.0) == 0
    paths.loads(request, cands, 0.0)
    assert paths.reserved == ()
    for i in range(1, 4):  # one a second
        paths.dispatched(_request(1500, f"s{i}"), one, 12, now_s=float(i), sensitive=True)
    assert paths.quiet_decoders_needed(3.0) == 1
    loads = paths.loads(request, cands, 3.0)
    assert paths.reserved == ("a",)  # the quieter one (b took the prefills)
    # while the split holds, a request that is not stall-sensitive is also served P/D onto
    # the quiet decoder (the fleet runs as 1P+1D), not whole on the engine that prefills
    decision = paths.decide(_request(1000, "long answer"), 160, loads)
    assert decision is not None and decision.reason == "split"
    assert (decision.plan.path, decision.plan.prefill_worker, decision.plan.worker) == \
        ("pd", "b", "a")
    # control: once the demand has decayed (a minute later) the same request goes whole
    loads = paths.loads(request, cands, 63.0)
    assert paths.reserved == ()
    later = paths.decide(_request(1000, "long answer"), 160, loads)
    assert later is not None and later.plan.path == "whole" and later.reason != "split"


def _split_of_two(paths: AdaptivePaths, sensitive_at: list[float]) -> None:
    """Stall-sensitive 12-token answers behind 1,500-token prompts, prefilled on b."""
    one = estimate_whole(COSTS, 1500, 12, EngineLoad("b"))
    for i, t in enumerate(sensitive_at):
        paths.dispatched(_request(1500, f"s{i}"), one, 12, now_s=t, sensitive=True)


def test_a_quiet_decoder_stays_quiet_through_a_burst_of_prefills() -> None:
    """The prefill-load cap binds when a decoder would be reserved, not after: a burst of long
    prompts must not turn the quiet decoder into a prefiller under the short answers it
    still decodes."""
    cands = [("flex", Candidate(w)) for w in ("a", "b")]
    request = _request(1500, "next")
    burst = estimate_whole(COSTS, 1500, 64, EngineLoad("b"))

    paths = _paths(tpot=0.025)
    _split_of_two(paths, [0.0, 1.0, 2.0, 3.0])
    paths.loads(request, cands, 3.0)
    assert paths.reserved == ("a",)
    for i in range(100):  # 15 s of prefill on b within 3 s: over 0.7 of an engine
        paths.dispatched(_request(1500, f"burst{i}"), burst, 64, now_s=3.0 + i * 0.03)
    paths.loads(request, cands, 6.0)
    assert paths.reserved == ("a",)
    # control: the same demand and burst with no decoder reserved yet reserves none
    fresh = _paths(tpot=0.025)
    for i in range(100):
        fresh.dispatched(_request(1500, f"burst{i}"), burst, 64, now_s=3.0 + i * 0.03)
    _split_of_two(fresh, [3.0, 4.0, 5.0, 6.0])
    fresh.loads(request, cands, 6.0)
    assert fresh.quiet_decoders_needed(6.0) == 1 and fresh.reserved == ()


def test_a_short_prompt_is_served_whole_on_the_quiet_decoder() -> None:
    """A prefill within the hop (20 ms) plus one token's slack (a 20 ms target, 11 ms steps)
    runs whole on the quiet decoder: no hop and no wait behind the long prompts on b."""
    paths = _paths(tpot=0.025)
    cands = [("flex", Candidate(w)) for w in ("a", "b")]
    _split_of_two(paths, [0.0, 1.0, 2.0, 3.0])
    for tokens in (50, 250):  # 5 ms and 25 ms of prefill: 250 is over one token's slack alone
        loads = paths.loads(_request(tokens, "short"), cands, 3.0)
        assert paths.reserved == ("a",)
        decision = paths.decide(_request(tokens, "short"), 12, loads)
        assert decision is not None and decision.reason in ("split", "stall_sensitive")
        assert (decision.plan.path, decision.plan.worker) == ("whole", "a"), tokens
    # control: just past the bound (35 ms) and a long prompt (150 ms) still go P/D, from b
    for tokens in (350, 1500):
        loads = paths.loads(_request(tokens, "long"), cands, 3.0)
        decision = paths.decide(_request(tokens, "long"), 12, loads)
        assert decision is not None
        assert (decision.plan.path, decision.plan.prefill_worker, decision.plan.worker) == \
            ("pd", "b", "a"), tokens


def test_the_split_lends_its_quiet_decoder_when_the_prefiller_would_miss_the_ttft() -> None:
    # a is the quiet decoder; b prefills and has 3 s queued: the split's P/D b -> a misses a
    # 1 s TTFT for certain, while prefilling on a meets it
    engines = [EngineLoad("a", reserved=True), EngineLoad("b", queued_s=3.0)]
    decision = _paths().decide(_request(1500), 64, engines)
    assert decision is not None and decision.reason == "split_relief"
    assert (decision.plan.prefill_worker or decision.plan.worker) == "a"
    assert decision.plan.ttft_s < 1.0
    assert decision.other is not None and decision.other.ttft_s > 1.0  # the split's plan
    # control: with b's queue short the split's own plan stands
    calm = [EngineLoad("a", reserved=True), EngineLoad("b", queued_s=0.2)]
    decision = _paths().decide(_request(1500), 64, calm)
    assert decision is not None and decision.reason == "split"
    assert (decision.plan.path, decision.plan.prefill_worker, decision.plan.worker) == \
        ("pd", "b", "a")


def test_the_hop_waits_for_the_prefill_the_decoder_has_queued() -> None:
    # d has 0.5 s of its own prefill queued; p's 0.1 s prefill ends first, so the pull and the
    # decode's first step wait the other 0.4 s: in the TTFT and over the 63 token gaps
    busy = estimate_pd(COSTS, 1000, 64, EngineLoad("p"), EngineLoad("d", queued_s=0.5))
    idle = estimate_pd(COSTS, 1000, 64, EngineLoad("p"), EngineLoad("d"))
    assert busy.ttft_s == pytest.approx(idle.ttft_s + 0.4)
    assert busy.tpot_s == pytest.approx(idle.tpot_s + 0.4 / 63)
    # control: a decoder queue that ends before p's prefill does costs nothing
    queued_p = estimate_pd(COSTS, 1000, 64, EngineLoad("p", queued_s=1.0),
                           EngineLoad("d", queued_s=0.5))
    assert queued_p.ttft_s == pytest.approx(1.0 + idle.ttft_s)
    assert queued_p.tpot_s == pytest.approx(idle.tpot_s)


def test_a_relief_prefill_counts_every_short_answer_it_would_push_past_the_tpot() -> None:
    """The quiet decoder a holds four pending short answers, one already late. Prefilling a
    1,500-token prompt there (150 ms) would push the other three past the TPOT: three misses,
    against the one TTFT miss of the split's plan queued behind b's 3 s. Counted as one miss
    for all of them (as when they are not known one by one), the relief looked cheaper."""
    answers = ((4.0, 0.0, 0.0), (5.0, 0.0, 0.0), (6.0, 0.0, 0.0), (6.0, 0.06, 0.0))
    quiet = EngineLoad("a", reserved=True, running=4, admitted_output_tokens=4.0,
                       admitted_stall_s=0.06, admitted=answers)
    engines = [quiet, EngineLoad("b", queued_s=3.0)]
    decision = _paths().decide(_request(1500), 64, engines)
    assert decision is not None and decision.reason == "split"
    assert (decision.plan.path, decision.plan.prefill_worker, decision.plan.worker) == \
        ("pd", "b", "a")
    relief = estimate_whole(COSTS, 1500, 64, quiet)
    assert relief.expected_misses(1.0, 0.04) >= 4  # the four answers, each counted
    # control 1: the same engine known only by its worst cases: the relief is taken
    blind = [replace(quiet, admitted=()), EngineLoad("b", queued_s=3.0)]
    decision = _paths().decide(_request(1500), 64, blind)
    assert decision is not None and decision.reason == "split_relief"
    # control 2: long answers absorb the stall (150 ms over 199 gaps): the relief is taken
    long_answers = replace(quiet, admitted_output_tokens=200.0, admitted_stall_s=0.0,
                           admitted=((200.0, 0.0, 0.0),) * 4)
    decision = _paths().decide(_request(1500), 64, [long_answers, EngineLoad("b", queued_s=3.0)])
    assert decision is not None and decision.reason == "split_relief"
    assert (decision.plan.prefill_worker or decision.plan.worker) == "a"


def test_a_prefill_stalls_only_the_answers_decoding_by_the_time_it_ends() -> None:
    """A 2-token answer whose own prefill ends in 2 s is not stalled by a 30 ms prefill on its
    decoder now; the same answer decoding already is pushed past the 40 ms target."""
    pending = EngineLoad("a", running=1, admitted_output_tokens=2.0, admitted=((2.0, 0.0, 2.0),))
    decoding = replace(pending, admitted=((2.0, 0.0, 0.0),))
    assert estimate_whole(COSTS, 300, 12, pending).admitted_past(0.04) == 0
    assert estimate_whole(COSTS, 300, 12, decoding).admitted_past(0.04) == 1  # control
    # the router's own state: a P/D answer waiting 2 s for b's queue keeps no stall from a
    # whole prefill dispatched on its decoder meanwhile; one decoding there does
    paths = _paths()
    busy = estimate_whole(COSTS, 20000, 1, EngineLoad("b"))  # 2 s of prefill queued on b
    paths.dispatched(_request(20000, "queue"), busy, 1, now_s=0.0)
    pd = estimate_pd(COSTS, 1000, 2, EngineLoad("b", queued_s=2.0), EngineLoad("a"))
    paths.dispatched(_request(1000, "waits"), pd, 2, now_s=0.0)
    whole_a = estimate_whole(COSTS, 300, 12, EngineLoad("a"))
    paths.dispatched(_request(300, "short"), whole_a, 12, now_s=0.0)
    cands = [("flex", Candidate("a")), ("flex", Candidate("b"))]
    loads = {e.worker_id: e for e in paths.loads(_request(10, "next"), cands, 0.01)}
    stalls = sorted(stall for _, stall, _ in loads["a"].admitted)
    assert stalls == [0.0, 0.0]  # "waits" (pending) and "short" itself
    # control: once "waits" decodes (its prefill ended at 2.1 s), a prefill on a stalls it
    paths.dispatched(_request(300, "later"), whole_a, 12, now_s=2.5)
    loads = {e.worker_id: e for e in paths.loads(_request(10, "next"), cands, 2.51)}
    assert max(stall for _, stall, _ in loads["a"].admitted) > 0.0
