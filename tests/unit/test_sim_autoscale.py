"""Dynamic pools in the simulator: start delay, draining, billing, and the planner's result."""

from __future__ import annotations

import pytest

from bench.sim.autoscale import (
    AutoscaleSettings,
    ScriptedController,
    autoscale_summary,
    observation,
)
from bench.sim.engine import IntervalStats, Moves, simulate
from bench.sim.workload import SimRequest
from router.policy.base import CacheChanged, Dispatched, Membership, PolicyEvent
from router.policy.registry import create_prefill_policy
from router.policy.round_robin import RoundRobinPolicy


class Recorder(RoundRobinPolicy):
    """Round robin that remembers where each request went and every membership change."""

    def __init__(self) -> None:
        super().__init__()
        self.where: dict[int, str] = {}
        self.sent: dict[int, list[str]] = {}
        self.members: list[tuple[str, ...]] = []

    def observe(self, event: PolicyEvent) -> None:
        super().observe(event)
        if isinstance(event, Dispatched):
            self.where[int(event.request_id)] = event.worker_id
            self.sent.setdefault(int(event.request_id), []).append(event.worker_id)
        elif isinstance(event, Membership):
            self.members.append(event.worker_ids)


def req(i: int, t: float, prompt: int = 16, out: int = 1) -> SimRequest:
    return SimRequest(i, t, prompt, out, ())  # no block hashes: no prefix-cache hits


def test_added_instance_serves_only_after_its_start_delay() -> None:
    reqs = [req(i, 1.0 * i) for i in range(80)]  # one per second, each done in ~0.05 s
    policy = Recorder()
    ctl = ScriptedController((1, 1), [(10.0, 2, 1)], interval_s=10.0)
    res = simulate(reqs, policy, 0, 0, controller=ctl, start_delay_s=30.0)
    on_new = sorted(i for i, w in policy.where.items() if w == "p0001")
    assert on_new and min(on_new) >= 40  # decided at 10 s, serving from 40 s
    assert max(i for i, w in policy.where.items() if w == "p0000" and i < 40) == 39
    assert policy.members == [("p0000",), ("p0000", "p0001")]
    points = [(p.t_s, p.prefill_ready, p.prefill_target, p.prefill_billed) for p in res.replicas]
    assert points == [(0.0, 1, 1, 1), (10.0, 1, 2, 2), (40.0, 2, 2, 2)]
    assert [s.prefill_ready for s in ctl.seen[:5]] == [1, 1, 1, 2, 2]
    assert len(res.ttft_s) == 80


def test_drained_prefill_gets_no_new_work_and_finishes_its_queue() -> None:
    # 20 long prompts (1.62 s each) alternate over two instances just before the decision
    # at 10 s: each holds ~16 s of work; p0001 (the newest, equally loaded) is drained.
    long = [req(i, 9.0 + 0.05 * i, prompt=16_000) for i in range(20)]
    late = [req(20 + i, 10.5 + 0.5 * i, prompt=16) for i in range(20)]
    policy = Recorder()
    ctl = ScriptedController((2, 1), [(10.0, 1, 1)], interval_s=10.0)
    res = simulate(long + late, policy, 0, 0, controller=ctl, start_delay_s=30.0)
    assert {policy.where[i] for i in range(20, 40)} == {"p0000"}
    assert [policy.where[i] for i in range(4)] == ["p0000", "p0001", "p0000", "p0001"]
    assert policy.members == [("p0000", "p0001"), ("p0000",)]
    assert len(res.ttft_s) == 40  # the drained instance's ten requests completed too
    # p0001 ran 10 prompts back to back from 9.05 s; billed until the last one finished
    p1_stop = 9.05 + 10 * (0.02 + 1e-4 * 16_000)
    billed = [p for p in res.replicas if p.prefill_billed == 1]
    assert billed[0].t_s == pytest.approx(p1_stop)
    assert res.instance_s["prefill"] == pytest.approx(res.sim_end_s + p1_stop)


def _backlog(moves: Moves | None) -> tuple[Recorder, list[float], dict[str, int]]:
    """30 long prompts (1.62 s each) from 30 s on, 10 a second, queue on the one prefill
    instance; a second one, decided at 10 s, serves from 40 s."""
    reqs = [req(i, 30.0 + 0.1 * i, prompt=16_000) for i in range(30)]
    policy = Recorder()
    ctl = ScriptedController((1, 1), [(10.0, 2, 1)], interval_s=10.0)
    res = simulate(reqs, policy, 0, 0, controller=ctl, start_delay_s=30.0, moves=moves)
    return policy, res.ttft_s, res.redispatched


def test_scale_up_redispatches_waiting_requests_to_the_new_instance() -> None:
    policy, ttft, moved = _backlog(Moves())
    # batch i runs from 30 + 1.62 i: at 40 s request 6 is running (39.72 .. 41.34), so 0 .. 6
    # stay; of the 23 waiting, the rule moves the later ones while a move lowers the total
    # predicted TTFT: the new instance's tail stays below what each would wait on p0000
    movers = sorted(i for i, sent in policy.sent.items() if len(sent) == 2)
    assert all(policy.sent[i] == ["p0000", "p0001"] for i in movers)
    assert max(len(sent) for sent in policy.sent.values()) == 2  # moved at most once
    assert min(movers) >= 7 and len(movers) == moved["join"] >= 10
    assert moved == {"join": len(movers), "tick": 0, "evacuate": 0}
    assert {policy.where[i] for i in range(7)} == {"p0000"}
    assert len(ttft) == 30
    # negative control: without re-dispatch every request stays on p0000 and waits longer
    stay, stay_ttft, none = _backlog(None)
    assert all(len(sent) == 1 for sent in stay.sent.values())
    assert set(stay.where.values()) == {"p0000"} and none == {"join": 0, "tick": 0,
                                                               "evacuate": 0}
    assert sum(ttft) < 0.7 * sum(stay_ttft)


def test_removed_prefill_hands_its_queue_over_and_stops_after_its_batch() -> None:
    # the drained-instance scenario above with evacuation: at 10 s p0001 runs the batch it
    # started at 9.05 s (until 10.67 s) and hands its nine waiting prompts to p0000
    long = [req(i, 9.0 + 0.05 * i, prompt=16_000) for i in range(20)]
    late = [req(20 + i, 10.5 + 0.5 * i, prompt=16) for i in range(20)]
    policy = Recorder()
    ctl = ScriptedController((2, 1), [(10.0, 1, 1)], interval_s=10.0)
    res = simulate(long + late, policy, 0, 0, controller=ctl, start_delay_s=30.0,
                   moves=Moves(on_join=False))
    assert res.redispatched["evacuate"] == 9
    assert [policy.sent[i] for i in (1, 3)] == [["p0001"], ["p0001", "p0000"]]
    assert len(res.ttft_s) == 40
    p1_stop = 9.05 + (0.02 + 1e-4 * 16_000)
    billed = [p for p in res.replicas if p.prefill_billed == 1]
    assert billed[0].t_s == pytest.approx(p1_stop)
    assert res.instance_s["prefill"] == pytest.approx(res.sim_end_s + p1_stop)


def test_drained_decode_finishes_running_sequences() -> None:
    # 10 requests with 500 output tokens spread over two decode instances, then decode drops
    # to one at 10 s: the drained one keeps decoding its five to the end, takes nothing new
    first = [req(i, 5.0 + 0.1 * i, out=500) for i in range(10)]
    late = [req(10 + i, 11.0 + i, out=2) for i in range(10)]
    ctl = ScriptedController((1, 2), [(10.0, 1, 1)], interval_s=10.0)
    res = simulate(first + late, create_prefill_policy("round_robin"), 0, 0, controller=ctl)
    assert len(res.ttft_s) == 20
    drop = next(p for p in res.replicas if p.decode_billed == 1)
    assert drop.decode_ready == 1
    # still billed for two at 10 s (the drained one is decoding), one only after ~5 + 500
    # steps of ~13 ms
    assert [p.decode_billed for p in res.replicas if p.t_s == 10.0] == [2]
    assert 10.0 < drop.t_s < res.sim_end_s
    assert res.instance_s["decode"] == pytest.approx(res.sim_end_s + drop.t_s)


def test_instance_seconds_by_hand() -> None:
    # static 2 + 1: billed for the whole run
    one = [req(0, 0.0, prompt=100, out=1)]
    res = simulate(one, create_prefill_policy("round_robin"), 2, 1)
    end = 0.02 + 1e-4 * 100 + 5e-6 * 100 + (0.012 + 1e-4 + 2e-8 * 100)
    assert res.sim_end_s == pytest.approx(end)
    assert res.instance_s == {"prefill": pytest.approx(2 * end), "decode": pytest.approx(end)}
    # scaled: +1 prefill at 10 s (serving at 40 s), back to 1 at 60 s (idle: stops at once);
    # +1 decode at 20 s, cancelled at 30 s while still starting (billed 10 s)
    reqs = [req(i, 10.0 * i) for i in range(11)]  # last arrival at 100 s
    ctl = ScriptedController((1, 1), [(10.0, 2, 1), (20.0, 2, 2), (30.0, 2, 1),
                                      (60.0, 1, 1)], interval_s=10.0)
    res = simulate(reqs, create_prefill_policy("round_robin"), 0, 0, controller=ctl)
    last = 100.0 + 0.02 + 1e-4 * 16 + 5e-6 * 16 + (0.012 + 1e-4 + 2e-8 * 16)
    assert res.sim_end_s == pytest.approx(last)
    assert res.instance_s["prefill"] == pytest.approx(last + (60.0 - 10.0))
    assert res.instance_s["decode"] == pytest.approx(last + (30.0 - 20.0))
    m = autoscale_summary(res, 1.0, 0.1)
    assert m["instance_seconds"]["total"] == pytest.approx(2 * last + 60.0)
    assert m["replicas_max"] == {"prefill": 2, "decode": 2}
    assert m["slo_attainment"] == 1.0
    assert len(ctl.seen) == 10  # ticks stop after the last arrival


def test_slo_attainment_needs_both_slos() -> None:
    # request 0: fast; request 1 (long prompt) misses TTFT; TPOT is per request
    reqs = [req(0, 0.0, prompt=100, out=10), req(1, 0.0, prompt=16_000, out=10)]
    res = simulate(reqs, create_prefill_policy("round_robin"), 2, 1)
    m = autoscale_summary(res, ttft_slo_s=1.0, tpot_slo_s=0.1)
    assert m["slo_attainment_ttft"] == 0.5 and m["slo_attainment_tpot"] == 1.0
    assert m["slo_attainment"] == 0.5
    assert autoscale_summary(res, 1.0, 0.001)["slo_attainment"] == 0.0


def test_observation_from_interval_stats() -> None:
    stats = IntervalStats(now_s=20.0, interval_s=10.0, arrivals=4, uncached_tokens=2000,
                          output_tokens=400, ttft_s=(0.1, 0.2, 0.3, 0.4),
                          tpot_s=(0.02, 0.04), prefill_replicas=3, decode_replicas=2,
                          prefill_ready=2, decode_ready=2, prefill_busy=0.5, decode_slots=0.1,
                          uncached_per_request=(100, 200, 300, 400, 1000))
    obs = observation(stats)
    # lengths per request served (5 prefilled, 4 decoded), not per arrival
    assert (obs.arrivals, obs.mean_isl, obs.mean_osl) == (4, 400.0, 100.0)
    # p90 interpolates between ranks like bench.metrics.percentile: rank 0.9 x 4 = 3.6
    assert obs.p90_isl == pytest.approx(400 + 0.6 * (1000 - 400))
    assert (obs.prefill_starting, obs.decode_starting) == (1, 0)
    assert obs.ttft_mean_s == pytest.approx(0.25)
    assert obs.ttft_p90_s == pytest.approx(0.3 + 0.7 * 0.1)
    assert obs.tpot_mean_s == pytest.approx(0.03)
    assert obs.tpot_p90_s == pytest.approx(0.02 + 0.9 * 0.02)
    assert (obs.prefill_replicas, obs.decode_replicas) == (3, 2)


@pytest.mark.parametrize(("kw", "match"), [
    ({"mode": "magic"}, "unknown autoscaler"),
    ({"mode": "planner", "min_replicas": 3, "max_prefill": 2, "max_decode": 4}, "--min"),
    ({"mode": "planner", "interval_s": 0.0}, "interval"),
])
def test_settings_validation(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AutoscaleSettings(**kw)  # type: ignore[arg-type]


def _warm_run(warm_blocks: int) -> tuple[list[tuple[str, PolicyEvent]], float, float]:
    """12 prompts a second for 50 s, each one of 16 shared 64-block prefixes and 64 blocks of
    its own (2,048 tokens, ~0.1 s of prefill uncached): one prefill instance falls behind;
    a second one, decided at 10 s, serves from 40 s. Returns the placement events, the
    prefix-cache hit ratio, and the mean TTFT."""
    reqs = [SimRequest(i, i / 12, 2048, 1,
                       PREFIXES[i % 16] + tuple(10**6 + 64 * i + b for b in range(64)))
            for i in range(600)]
    log: list[tuple[str, PolicyEvent]] = []
    ctl = ScriptedController((1, 1), [(10.0, 2, 1)], interval_s=10.0)
    res = simulate(reqs, create_prefill_policy("dualmap"), 0, 0, controller=ctl,
                   start_delay_s=30.0, moves=Moves(on_join=False, warm_blocks=warm_blocks),
                   observer=lambda role, e: log.append((role, e)))
    return log, res.cached_tokens / res.prompt_tokens, sum(res.ttft_s) / len(res.ttft_s)


PREFIXES = [tuple(1000 * k + b for b in range(64)) for k in range(16)]


def test_a_joining_instance_is_warmed_with_the_prefixes_placement_will_send_it() -> None:
    log, hits, _ = _warm_run(warm_blocks=10_000)
    warmed = [e for role, e in log if isinstance(e, CacheChanged)]
    assert warmed and {e.worker_id for e in warmed} == {"p0001"}
    # every chain pulled is the leading blocks of a request placement would send p0001 (the
    # part p0000 held: a shared prefix, and the request's own blocks once p0000 ran it)
    sent = {e.request.block_hashes for _, e in log
            if isinstance(e, Dispatched) and e.request is not None}
    assert all(e.stored[:64] in PREFIXES and len(e.stored) in (64, 128) for e in warmed)
    assert all(any(h[:len(e.stored)] == e.stored for h in sent) for e in warmed)
    # the budget holds (whole chains: at most one chain over)
    small = [e for role, e in _warm_run(warm_blocks=100)[0] if isinstance(e, CacheChanged)]
    assert 0 < sum(len(e.stored) for e in small) < 100 + 128
    # negative control: without warming nothing is pulled, and fewer prompt tokens hit
    cold_log, cold_hits, _ = _warm_run(warm_blocks=0)
    assert not any(isinstance(e, CacheChanged) for _, e in cold_log)
    assert hits > cold_hits
