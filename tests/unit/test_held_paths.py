"""Held plans: a request waits in the router until the answers its prefill would push past the
TPOT have finished (``AdaptivePaths(defer=True)``, ``--hold-prefills``), each with its control."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest

from bench.sim.fleet import FleetSettings, make_fleet, simulate_fleet
from bench.sim.workload import SimRequest
from router.api.holds import Holds
from router.config import load
from router.policy.adaptive import (
    HOLD_SLACK,
    HOLD_SLACK_MIN_S,
    REASONS,
    AdaptivePaths,
    hold_limit_s,
)
from router.policy.base import Candidate, RouteRequest
from router.policy.hashing import block_hashes
from router.policy.path_cost import (
    EngineLoad,
    PathCosts,
    PlanEstimate,
    estimate_pd_deferred,
    estimate_whole,
    estimate_whole_deferred,
)

COSTS = PathCosts(prefill_s_per_token=1e-4, prefill_fixed_s=0.0, decode_step_s=0.01,
                  decode_step_s_per_seq=0.001, hop_s=0.02, pull_s_per_token=0.0)
HELD_FLEET, NOW_FLEET = "adaptive", "adaptive_nohold"
"""Simulated fleets of flex engines with and without held plans."""
TARGET = 0.04
"""The TPOT the plans aim for: a 50 ms SLO x the 0.8 margin."""


def _request(tokens: int, rid: str = "r") -> RouteRequest:
    ids = tuple(range(tokens)) if rid == "r" else tuple(range(7, 7 + tokens))
    return RouteRequest(request_id=rid, model="m", prompt_token_ids=ids,
                        block_hashes=block_hashes(ids))


def _short_answer(ends_s: float, output: float = 4.0, queued_s: float = 0.0,
                  worker: str = "a") -> EngineLoad:
    """An engine decoding one short answer (request ``<worker>-answer``) that sends its last
    token in ``ends_s``."""
    return EngineLoad(worker, queued_s=queued_s, running=1, admitted=((output, 0.0, 0.0),),
                      admitted_ends_s=(ends_s,), admitted_ids=(f"{worker}-answer",))


def test_a_prefill_that_would_stall_a_short_answer_waits_for_it_to_end() -> None:
    # 2,000 tokens = 0.2 s of prefill: over a 4-token answer's 3 gaps, 67 ms more per token
    held = estimate_whole_deferred(COSTS, 2000, 64, _short_answer(0.03), TARGET)
    assert held is not None
    assert held.hold_s == pytest.approx(0.03) and held.waits_for == ("a-answer",)
    assert held.ttft_s == pytest.approx(0.03 + 0.2)
    assert held.admitted_past(TARGET) == 0 and held.admitted_tpots_s == ()
    # control: a 200-token answer takes the same stall over 199 gaps (1 ms each): nothing waits
    assert estimate_whole_deferred(COSTS, 2000, 64, _short_answer(1.5, output=200.0),
                                   TARGET) is None
    # control: the engine's own queue outlasts the answer, holding buys nothing
    assert estimate_whole_deferred(COSTS, 2000, 64, _short_answer(0.03, queued_s=0.5),
                                   TARGET) is None


def test_a_held_pd_plan_waits_only_for_its_prefiller() -> None:
    prefill, decode = _short_answer(0.03), _short_answer(0.5, worker="b")
    held = estimate_pd_deferred(COSTS, 2000, 64, prefill, decode, TARGET)
    assert held is not None and held.path == "pd"
    assert held.hold_s == pytest.approx(0.03)  # not b's answer: a pull stalls no one there
    assert held.waits_for == ("a-answer",)
    assert held.admitted_past(TARGET) == 0
    # control: an idle prefiller has nothing to wait for
    assert estimate_pd_deferred(COSTS, 2000, 64, EngineLoad("a"), decode, TARGET) is None


def test_holding_beats_stalling_or_moving_the_request() -> None:
    engines = [_short_answer(0.03), _short_answer(0.05, worker="b")]
    held = AdaptivePaths(COSTS, 1.0, 0.05, defer=True).decide(_request(2000), 64, engines)
    assert held is not None and held.reason == "held" and "held" in REASONS
    assert (held.plan.path, held.plan.worker) == ("whole", "a")  # the earlier first token
    assert held.plan.hold_s == pytest.approx(0.03)
    # control: without holding, every plan sent now stalls one of the two answers
    now = AdaptivePaths(COSTS, 1.0, 0.05).decide(_request(2000), 64, engines)
    assert now is not None and now.plan.hold_s == 0.0
    assert now.plan.admitted_past(TARGET) == 1


def test_a_hold_that_would_miss_the_ttft_is_not_taken() -> None:
    # the answers end in 0.9 s: held, the first token comes at 1.1 s, past the 1 s SLO
    engines = [_short_answer(0.9), _short_answer(0.9, worker="b")]
    decision = AdaptivePaths(COSTS, 1.0, 0.05, defer=True).decide(_request(2000), 64, engines)
    assert decision is not None and decision.reason == "best_effort"
    assert decision.plan.hold_s == 0.0
    # control: a looser TTFT SLO takes the hold
    loose = AdaptivePaths(COSTS, 2.0, 0.05, defer=True).decide(_request(2000), 64, engines)
    assert loose is not None and loose.reason == "held"


def test_a_held_prefill_is_booked_after_the_answers_it_waited_for() -> None:
    one = [("flex", Candidate("a", 0, False, 0, 0))]
    for defer in (True, False):
        paths = AdaptivePaths(COSTS, 1.0, 0.05, defer=defer)
        first = paths.decide(_request(100, "short"), 4, paths.loads(_request(100, "short"),
                                                                    one, 0.0))
        assert first is not None
        paths.dispatched(_request(100, "short"), first.plan, 4, 0.0)  # decodes 0.01-0.04 s
        loads = paths.loads(_request(2000), one, 0.011)
        assert loads[0].admitted_ends_s == (pytest.approx(0.029),)
        decision = paths.decide(_request(2000), 64, loads)
        assert decision is not None
        paths.dispatched(_request(2000), decision.plan, 64, 0.011)
        after = paths.loads(_request(10, "next"), one, 0.012)[0]
        stalls = {out: stall for out, stall, _ in after.admitted}
        if defer:
            assert decision.plan.hold_s == pytest.approx(0.029)
            assert after.booked_s == pytest.approx(0.04 + 0.2 - 0.012)
            assert after.queued_s == 0.0  # not sent yet: a request sent now goes first
            assert stalls[4.0] == 0.0  # it ended before the prefill started
            assert after.prefill_rate == 0.0  # no prefill landed on an answer here
        else:  # control: sent at once, the prefill stalls the short answer
            assert decision.plan.hold_s == 0.0
            assert stalls[4.0] > 0.0
            assert after.prefill_rate > 0.0


def test_with_holds_an_answer_is_exposed_only_to_prefills_sent_past_answers() -> None:
    one = [("flex", Candidate("a", 0, False, 0, 0))]
    # a TTFT of 0.15 s leaves no room to wait: the 0.2 s prefill misses it, and is sent now
    # onto the short answer it stalls
    paths = AdaptivePaths(COSTS, 0.15, 0.05, defer=True)
    paths.dispatched(_request(100, "short"), paths.decide(  # type: ignore[union-attr]
        _request(100, "short"), 4, paths.loads(_request(100, "short"), one, 0.0)).plan, 4, 0.0)
    decision = paths.decide(_request(2000), 64, paths.loads(_request(2000), one, 0.011))
    assert decision is not None and decision.reason == "best_effort"
    assert decision.plan.admitted_past(TARGET) == 1
    paths.dispatched(_request(2000), decision.plan, 64, 0.011)
    after = paths.loads(_request(10, "next"), one, 0.012)[0]
    assert after.prefill_rate == pytest.approx(0.1, rel=0.01)  # one such prefill in 10 s


def test_the_router_flag_and_its_environment_variable() -> None:
    assert load([], env={}).hold_prefills is True
    assert load(["--no-hold-prefills"], env={}).hold_prefills is False
    assert load([], env={"PDSERVE_ROUTER_HOLD_PREFILLS": "0"}).hold_prefills is False


def test_holds_release_a_request_when_the_answers_it_waits_for_end() -> None:
    async def scenario() -> tuple[float, float, float, int]:
        holds = Holds()
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, holds.ended, "x")
        loop.call_later(0.10, holds.ended, "y")
        both = await holds.wait(("x", "y"), timeout_s=5.0)  # until the later of the two
        # control: an answer that never ends releases it at the deadline
        stuck = await holds.wait(("never",), timeout_s=0.05)
        nothing = await holds.wait((), timeout_s=5.0)
        return both, stuck, nothing, len(holds)
    both, stuck, nothing, left = asyncio.run(scenario())
    assert 0.09 <= both < 2.0
    assert 0.04 <= stuck < 2.0
    assert nothing == 0.0
    assert left == 0  # nothing is kept for an id nobody waits for any more


def test_a_held_fleet_keeps_short_answers_clear_of_a_long_prefill() -> None:
    # two 4-token answers, one per engine, then a 2,000-token prompt while they decode
    trace = [SimRequest(0, 0.0, 100, 4, ()), SimRequest(1, 0.001, 100, 4, ()),
             SimRequest(2, 0.03, 2000, 64, ())]
    settings = FleetSettings(1.0, 0.05, warmup_s=0.0)
    held = simulate_fleet(trace, make_fleet(HELD_FLEET, 2), settings)
    assert held.reasons["held"] == 1
    assert max(held.tpot_s[:2]) < 0.01  # each answer's steps alone
    assert held.ttft_s[2] > 0.01 + 2000 * 1.5e-4  # it waited for them first
    # control: sent at once, the prefill lands under one of the short answers
    now = simulate_fleet(trace, make_fleet(NOW_FLEET, 2), settings)
    assert now.reasons["held"] == 0
    assert max(now.tpot_s[:2]) > 0.05


def test_an_answer_past_its_predicted_end_is_not_waited_for() -> None:
    one = [("flex", Candidate("a", 0, False, 0, 0))]
    paths = AdaptivePaths(COSTS, 1.0, 0.05, defer=True)
    first = paths.decide(_request(100, "short"), 4, paths.loads(_request(100, "short"), one, 0.0))
    assert first is not None
    paths.dispatched(_request(100, "short"), first.plan, 4, 0.0)  # predicted to end at 0.04 s
    late = paths.loads(_request(2000), one, 0.5)  # still decoding at 0.5 s: slower than known
    assert late[0].admitted_ends_s == (math.inf,)
    decision = paths.decide(_request(2000), 64, late)
    assert decision is not None and decision.plan.hold_s == 0.0
    # control: before its predicted end it is waited for
    early = paths.loads(_request(2000), one, 0.02)
    held = paths.decide(_request(2000), 64, early)
    assert held is not None and held.reason == "held" and held.plan.waits_for == ("short",)


def test_a_hold_is_bounded_by_its_prediction_and_by_the_ttft() -> None:
    held = estimate_whole_deferred(COSTS, 2000, 64, _short_answer(0.03), TARGET)
    assert held is not None
    assert hold_limit_s(held, 1.0) == pytest.approx(0.03 * (1 + HOLD_SLACK) + HOLD_SLACK_MIN_S)
    # a TTFT SLO that leaves no more than the predicted hold: never less than the prediction
    assert hold_limit_s(held, 0.2) == pytest.approx(0.03)
    # between the two: until the moment its own TTFT would miss
    assert hold_limit_s(held, 0.3) == pytest.approx(0.3 - 0.2)


def _booked(hold_s: float, tokens: int = 1000) -> PlanEstimate:
    """A whole plan on engine a for ``tokens`` (0.1 s of prefill per 1,000), held ``hold_s``."""
    return replace(estimate_whole(COSTS, tokens, 64, EngineLoad("a")), hold_s=hold_s)


def _prompt(rid: str, first: int, tokens: int = 1000) -> RouteRequest:
    """A request whose prompt shares no block with one starting elsewhere."""
    ids = tuple(range(first, first + tokens))
    return RouteRequest(request_id=rid, model="m", prompt_token_ids=ids,
                        block_hashes=block_hashes(ids))


def test_a_request_sent_while_another_is_held_waits_only_for_the_sent_prefills() -> None:
    one = [("flex", Candidate("a", 0, False, 0, 0))]
    paths = AdaptivePaths(COSTS, 1.0, 0.05, defer=True)
    paths.dispatched(_prompt("sent", 0), _booked(0.0), 64, 0.0)  # runs 0-0.1 s
    paths.dispatched(_prompt("held", 10_000), _booked(0.5), 64, 0.0)  # sent at 0.5: 0.5-0.6
    nxt = _prompt("next", 20_000)
    load = paths.loads(nxt, one, 0.05)[0]
    assert load.queued_s == pytest.approx(0.05)  # behind "sent" only
    assert load.booked_s == pytest.approx(0.55)  # a held one goes behind "held" too
    now = paths.decide(nxt, 64, [load])
    assert now is not None and now.reason == "whole_meets_slo"
    assert now.plan.ttft_s == pytest.approx(0.15)
    # it reaches the engine before "held" is sent: "held" runs after it, still from 0.5
    paths.dispatched(nxt, now.plan, 64, 0.05)
    later = paths.loads(_prompt("x", 30_000, 10), one, 0.05)[0]
    assert later.queued_s == pytest.approx(0.15)
    assert later.booked_s == pytest.approx(0.55)
    starts = dict(zip(later.admitted_ids, (a[2] for a in later.admitted), strict=True))
    assert starts == pytest.approx({"sent": 0.05, "held": 0.55, "next": 0.15})
    # control: without the hold, "held" is sent at once and "next" queues behind it
    eager = AdaptivePaths(COSTS, 1.0, 0.05, defer=True)
    eager.dispatched(_prompt("sent", 0), _booked(0.0), 64, 0.0)
    eager.dispatched(_prompt("held", 10_000), _booked(0.0), 64, 0.0)
    assert eager.loads(nxt, one, 0.05)[0].queued_s == pytest.approx(0.15)


def test_a_prefill_heard_early_does_not_bring_a_held_one_before_it_is_sent() -> None:
    one = [("flex", Candidate("a", 0, False, 0, 0))]
    paths = AdaptivePaths(COSTS, 1.0, 0.05, defer=True)
    paths.dispatched(_prompt("r1", 0), _booked(0.0), 64, 0.0)  # 0-0.1
    paths.dispatched(_prompt("r2", 10_000), _booked(0.3), 64, 0.0)  # held: 0.3-0.4
    paths.dispatched(_prompt("r3", 20_000), _booked(0.0), 64, 0.0)  # sent: 0.1-0.2

    def load(now: float) -> EngineLoad:
        return paths.loads(_prompt("x", 30_000, 10), one, now)[0]

    assert (load(0.0).queued_s, load(0.0).booked_s) == pytest.approx((0.2, 0.4))
    paths.prefilled("r1", 0.02)  # 0.08 s early: r3 moves up, held r2 still waits for 0.3
    assert (load(0.02).queued_s, load(0.02).booked_s) == pytest.approx((0.1, 0.38))
    paths.prefilled("r3", 0.5)  # r3 ran 0.38 s late; r2, still held, goes after it
    assert (load(0.5).queued_s, load(0.5).booked_s) == pytest.approx((0.0, 0.1))
    paths.released("r2", 0.6)  # sent late (its answers outlived their predicted ends)
    assert (load(0.6).queued_s, load(0.6).booked_s) == pytest.approx((0.1, 0.1))
    paths.released("r2", 0.65)  # sent once: a second word changes nothing
    assert load(0.6).queued_s == pytest.approx(0.1)
    paths.finished("r2")  # it ended (failed) before its prefill was heard: nothing is booked
    assert (load(0.6).queued_s, load(0.6).booked_s) == (0.0, 0.0)


def test_the_simulated_fleet_tells_the_policy_when_it_sends_a_held_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    trace = [SimRequest(0, 0.0, 100, 4, ()), SimRequest(1, 0.001, 100, 4, ()),
             SimRequest(2, 0.03, 2000, 64, ())]
    sent: list[str] = []
    original = AdaptivePaths.released

    def spy(self: AdaptivePaths, request_id: str, now_s: float) -> None:
        sent.append(request_id)
        original(self, request_id, now_s)

    monkeypatch.setattr(AdaptivePaths, "released", spy)
    held = simulate_fleet(trace, make_fleet(HELD_FLEET, 2), FleetSettings(1.0, 0.05,
                                                                          warmup_s=0.0))
    assert held.reasons["held"] == 1 and len(sent) == 1
    # control: without holds nothing is sent late
    sent.clear()
    now = simulate_fleet(trace, make_fleet(NOW_FLEET, 2), FleetSettings(1.0, 0.05, warmup_s=0.0))
    assert now.reasons["held"] == 0 and sent == []


def test_a_stall_the_margin_absorbs_is_not_waited_for() -> None:
    # an answer at 39 ms of a 40 ms target (13 tokens, 12 gaps, ending in 0.2 s)
    answer = EngineLoad("a", running=1, admitted=((13.0, 0.028, 0.0),),
                        admitted_ends_s=(0.2,), admitted_ids=("a-answer",))
    paths = AdaptivePaths(COSTS, 1.0, 0.05, defer=True)
    assert paths.material_s == pytest.approx(0.01)  # the SLO less the target
    # 150 tokens: 15 ms of prefill, 1.25 ms per gap of the answer: past the target, not
    # past the SLO: sent now, not held
    short = paths.decide(_prompt("short", 0, 150), 64, [answer])
    assert short is not None and short.reason == "whole_meets_slo" and short.plan.hold_s == 0
    # 2,000 tokens: 17 ms per gap, more than the margin: it waits for the answer
    long = paths.decide(_prompt("long", 0, 2000), 64, [answer])
    assert long is not None and long.reason == "held" and long.plan.waits_for == ("a-answer",)
    # control: with every stall counted the short prompt waits as well
    paths.material_s = 0.0
    counted = paths.decide(_prompt("short", 0, 150), 64, [answer])
    assert counted is not None and counted.reason == "held"
