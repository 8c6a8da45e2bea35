"""The simulator's colocated engines and fleets routed by the router's ``AdaptivePaths``:
timing by hand, the paths each fleet takes, the rate search and the CLI's argument errors."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.sim.cli import main as sim_main
from bench.sim.colocated import ColocatedEngine
from bench.sim.fleet import FleetSettings, make_fleet, simulate_fleet
from bench.sim.path_workloads import WORKLOADS, PathWorkload
from bench.sim.paths import CompareConfig, capacity
from bench.sim.sweep import highest_rate
from bench.sim.workload import SimRequest
from router.policy.path_cost import PathCosts

COSTS = PathCosts()  # prefill 0.01 + 1.5e-4/token, step 0.006 + 0.0003/extra seq, hop 0.05


def _short(name: str, duration_s: float) -> PathWorkload:
    w = WORKLOADS[name]
    return PathWorkload(w.name, w.ttft_slo_s, w.tpot_slo_s, duration_s, w.shape)


def _paths(name: str, fleet: str, n: int, rate_rps: float) -> Counter[str]:
    w = _short(name, 20.0)
    res = simulate_fleet(w.requests(rate_rps, 0), make_fleet(fleet, n),
                         FleetSettings(w.ttft_slo_s, w.tpot_slo_s, warmup_s=0.0))
    return res.paths


def _one(fleet: str, prompt: int, output: int) -> tuple[float, float]:
    res = simulate_fleet([SimRequest(0, 0.0, prompt, output, ())], make_fleet(fleet, 2),
                         FleetSettings(1.0, 0.05, warmup_s=0.0))
    return res.ttft_s[0], res.tpot_s[0]


def test_whole_request_timing_by_hand() -> None:
    ttft, tpot = _one("aggregated", 1000, 3)
    assert ttft == pytest.approx(0.01 + 1000 * 1.5e-4)  # its prefill's iteration
    assert tpot == pytest.approx(0.006)  # two more steps, alone in the batch


def test_pd_request_timing_by_hand() -> None:
    ttft, tpot = _one("pd1:1", 1000, 3)
    assert ttft == pytest.approx(0.16 + 0.05)  # prefill + hop
    # the KV lands 1000 x 2e-6 after the first token, then two steps on the decode engine
    assert tpot == pytest.approx((1000 * 2e-6 + 2 * 0.006) / 2)


def _finish_of_decoder(prefill_at_s: float | None) -> float:
    """When a 10-token sequence ends on an engine that gets a 1000-token prompt at
    ``prefill_at_s`` (None: never)."""
    e = ColocatedEngine[str]("e0", "flex", COSTS, chunk_tokens=2048, cache_blocks=100)
    e.add_decode("a", 10)
    events = [e.wake(0.0)]
    if prefill_at_s is not None:
        e.add_prefill("b", 1000)
        events.append(e.wake(prefill_at_s))
    while True:
        end = [t for t in events if t is not None][-1]
        prefilled, finished = e.complete(end)
        if "a" in finished:
            return end
        events = [e.wake(end)]


def test_colocated_prefill_stalls_the_decode_batch() -> None:
    alone = _finish_of_decoder(None)
    assert alone == pytest.approx(10 * 0.006)
    # cut at the end of the step in progress (4th), one iteration carries prefill + a step
    stalled = _finish_of_decoder(0.02)
    assert stalled == pytest.approx(10 * 0.006 + 0.16)


def test_static_pd_fleet_never_serves_whole() -> None:
    assert set(_paths("mix", "pd1:1", 4, 6.0)) == {"pd"}
    # negative control: the same load on flex engines is mostly served whole
    adaptive = _paths("mix", "adaptive", 4, 6.0)
    assert adaptive["whole"] > adaptive["pd"]


def test_aggregated_fleet_only_serves_whole() -> None:
    assert set(_paths("prefill_heavy", "aggregated", 4, 17.5)) == {"whole"}


def test_adaptive_decode_heavy_tight_tpot_takes_mostly_whole() -> None:
    paths = _paths("decode_heavy", "adaptive_nohold", 4, 20.0)
    assert paths["whole"] >= 0.9 * sum(paths.values())


def test_adaptive_without_holds_prefill_heavy_takes_pd_under_load_only() -> None:
    saturated = _paths("prefill_heavy", "adaptive_nohold", 4, 17.5)
    assert saturated["pd"] >= 0.1 * sum(saturated.values())
    # negative control: at under a quarter of that rate every request is served whole (a
    # short answer's wait for its own prefill is short, so few neighbours' prefills land on
    # it: none P/D at 4 req/s when written, 24 of 143 at 8)
    calm = _paths("prefill_heavy", "adaptive_nohold", 4, 4.0)
    assert calm["pd"] <= 0.05 * sum(calm.values()), calm


def test_fleet_ratios() -> None:
    def split(name: str) -> tuple[int, int]:
        roles = make_fleet(name, 16).roles
        return roles.count("prefill"), roles.count("decode")

    assert [split(n) for n in ("pd1:3", "pd1:2", "pd1:1", "pd2:1", "pd3:1")] == [
        (4, 12), (5, 11), (8, 8), (11, 5), (12, 4)]
    assert make_fleet("pd1:3", 2).roles == ("prefill", "decode")
    assert make_fleet("adaptive", 3).force is None
    with pytest.raises(ValueError, match="allowed: adaptive"):
        make_fleet("pd5:1", 16)


def test_workload_shapes_do_not_depend_on_the_rate() -> None:
    slow = WORKLOADS["mix"].requests(5.0, 3)
    fast = WORKLOADS["mix"].requests(10.0, 3)
    assert len(fast) > len(slow)
    assert [(r.prompt_tokens, r.output_tokens) for r in slow] == [
        (r.prompt_tokens, r.output_tokens) for r in fast[:len(slow)]]
    switch = _short("switch", 120.0).requests(5.0, 0)
    assert max(r.output_tokens for r in switch if r.arrival_s < 60) <= 32
    assert min(r.output_tokens for r in switch if r.arrival_s >= 60) >= 224


def test_multiturn_prompts_share_prefixes() -> None:
    reqs = _short("multiturn", 60.0).requests(2.0, 0)
    firsts = Counter(r.block_hashes[0] for r in reqs if r.block_hashes)
    assert firsts.most_common(1)[0][1] > 1
    assert max(r.prompt_tokens for r in reqs) <= 4096


@pytest.mark.parametrize(("limit", "start"), [(37.0, 10.0), (37.0, 200.0)])
def test_highest_rate_within_five_percent(limit: float, start: float) -> None:
    found = highest_rate(lambda r: r <= limit, start, 5)
    assert limit * 0.95 <= found <= limit
    assert highest_rate(lambda r: False, start, 5) == 0.0


def test_paths_cli_rejects_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_main(["paths", "--fleets", "adaptive,pd9:1"]) == 2
    assert "allowed: adaptive, adaptive_nohold, aggregated, pd1:3" in capsys.readouterr().err
    assert sim_main(["paths", "--workloads", "nope"]) == 2


def test_run_stops_once_its_attainment_cannot_reach_the_bar() -> None:
    w = _short("mix", 30.0)
    settings = FleetSettings(w.ttft_slo_s, w.tpot_slo_s, warmup_s=5.0)
    fleet = make_fleet("adaptive", 2)
    over = w.requests(40.0, 1)  # far past two engines' capacity
    whole = simulate_fleet(over, fleet, settings)
    assert whole.stopped_s is None and whole.attainment(w.ttft_slo_s, w.tpot_slo_s) < 0.9
    early = simulate_fleet(over, fleet, settings, give_up_below=0.9)
    assert early.stopped_s is not None and early.stopped_s < over[-1].arrival_s
    assert len(early.ttft_s) < len(whole.ttft_s)
    # what it measured before stopping is what the whole run measured for those requests
    assert early.ttft_s == whole.ttft_s[:len(early.ttft_s)]


def test_run_that_meets_the_bar_is_not_stopped_and_unchanged() -> None:
    w = _short("mix", 30.0)
    settings = FleetSettings(w.ttft_slo_s, w.tpot_slo_s, warmup_s=5.0)
    fleet = make_fleet("adaptive", 2)
    light = w.requests(1.0, 1)
    whole = simulate_fleet(light, fleet, settings)
    assert whole.attainment(w.ttft_slo_s, w.tpot_slo_s) >= 0.9  # negative control
    early = simulate_fleet(light, fleet, settings, give_up_below=0.9)
    assert early.stopped_s is None
    assert (early.ttft_s, early.tpot_s, early.paths, early.reasons, early.prefill_share) == \
        (whole.ttft_s, whole.tpot_s, whole.paths, whole.reasons, whole.prefill_share)


def test_capacity_search_finds_the_same_rate_when_runs_stop_early() -> None:
    w = _short("mix", 20.0)
    cfg = CompareConfig(instances=2, seeds=(1,), settings=FleetSettings(1.0, 0.05,
                                                                        warmup_s=5.0))
    found = capacity(w, "adaptive", 1, cfg, 1.0)
    assert found.rate_rps > 0 and found.at_capacity is not None
    assert found.at_capacity.stopped_s is None
    # the same search with every run played to its end
    settings = FleetSettings(w.ttft_slo_s, w.tpot_slo_s, warmup_s=5.0)

    def ok(rate: float) -> bool:
        res = simulate_fleet(w.requests(rate, 1), make_fleet("adaptive", 2), settings)
        return res.attainment(w.ttft_slo_s, w.tpot_slo_s) >= 0.9

    assert highest_rate(ok, 1.0, cfg.bisect_steps) == found.rate_rps
