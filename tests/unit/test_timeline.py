"""Phase timelines: the connector's cross-process join and the router's clock (pure)."""

from __future__ import annotations

import pytest

from kvtransfer.timeline import DECODE_CHAIN, PREFILL_CHAIN, PhaseJoiner
from router.api.timeline import EVENTS, PhaseClock


def test_decode_chain_joins_events_from_both_halves_in_any_order() -> None:
    joiner = PhaseJoiner()
    stamps = dict(zip(DECODE_CHAIN, (10.0, 10.004, 10.010, 10.011, 10.013, 10.020), strict=True))
    scheduler = [("r1", e, stamps[e]) for e in ("remote_seen", "finished_seen", "first_scheduled")]
    worker = [("r1", e, stamps[e]) for e in ("pull_started", "read_done", "release_answered")]
    assert joiner.add(scheduler[:1]) == []
    assert joiner.add(worker) == []  # not complete: finished_seen/first_scheduled missing
    (done,) = joiner.add(scheduler[1:])
    assert done.role == "decode"
    assert done.phases == pytest.approx({
        "decode_wait_pull": 0.004, "decode_read": 0.006, "decode_release": 0.001,
        "decode_report": 0.002, "decode_schedule": 0.007})
    assert done.total_s == pytest.approx(0.020)
    assert len(joiner) == 0


def test_prefill_chain_and_first_stamp_wins() -> None:
    joiner = PhaseJoiner()
    events = [("p", e, t) for e, t in zip(PREFILL_CHAIN, (1.0, 1.5, 1.501, 1.6), strict=True)]
    events.insert(1, ("p", "admitted", 1.2))  # a second admission stamp is ignored
    (done,) = joiner.add(events)
    assert done.role == "prefill"
    assert done.phases["prefill_queue_and_compute"] == pytest.approx(0.5)
    assert done.total_s == pytest.approx(0.6)


def test_incomplete_requests_are_dropped_by_age_and_count() -> None:
    joiner = PhaseJoiner(max_open=2, max_age_s=60)
    joiner.add([("a", "remote_seen", 0.0), ("b", "remote_seen", 1.0), ("c", "remote_seen", 2.0)])
    assert len(joiner) == 2  # "a" evicted by count
    joiner.add([("d", "remote_seen", 100.0)])
    assert len(joiner) == 1  # "b" and "c" older than 60 s


def test_router_phases_sum_to_the_end_to_end_time() -> None:
    clock = PhaseClock.start("x")
    for event in EVENTS[1:]:
        clock.mark(event)
    phases = clock.phases()
    assert list(phases) == ["validate", "prefill_choose", "prefill", "decode_choose",
                            "decode_first_byte", "stream"]
    assert sum(phases.values()) == pytest.approx(clock.mono["done"] - clock.started)
    record = clock.record()
    assert set(record["events"]) == set(EVENTS)  # type: ignore[arg-type]


def test_router_clock_keeps_the_first_stamp_and_rejects_unknown_events() -> None:
    clock = PhaseClock.start("x")
    clock.mark("prefill_chosen")
    first = clock.mono["prefill_chosen"]
    clock.mark("prefill_chosen")  # a retry
    assert clock.mono["prefill_chosen"] == first
    assert list(clock.phases()) == ["prefill_choose"]
    with pytest.raises(ValueError):
        clock.mark("nonsense")


def test_the_prefilled_hook_fires_once_at_the_prefill_answer_or_the_first_token() -> None:
    heard: list[str] = []
    pd = PhaseClock.start("pd")
    pd.on_prefilled = lambda: heard.append("pd")
    pd.mark("validated")
    assert heard == []  # control: another event is not the prefill's end
    pd.mark("prefill_answered")
    pd.saw_first_output(1.0)
    pd.mark("prefill_answered")
    assert heard == ["pd"]
    whole = PhaseClock.start("whole")
    whole.on_prefilled = lambda: heard.append("whole")
    whole.saw_first_output(2.0)
    whole.saw_first_output(3.0)
    assert heard == ["pd", "whole"] and whole.first_output == 2.0
