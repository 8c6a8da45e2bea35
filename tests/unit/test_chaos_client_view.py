"""`pdserve chaos` counts what the clients saw and what the router did about each fault."""

from __future__ import annotations

from serve.chaos.faults import Injected
from serve.chaos.load import Outcome
from serve.chaos.router_tally import MOVES, PATHS, REFUSED, CounterTally
from serve.chaos.runner import client_view


def _o(i: int, outcome: str, sent_at: float, *, status: int = 200, ttft: float | None = 0.1,
       error: str = "") -> Outcome:
    return Outcome(i, 0, "normal", outcome=outcome, sent_at=sent_at, status=status,
                   ttft_s=ttft, error=error)


def test_client_failures_are_judged_per_fault_and_429_or_aborts_are_not_failures() -> None:
    faults = [Injected("kill_decode", at=10.0), Injected("redis_outage", at=20.0)]
    outcomes = [_o(0, "completed", 5.0),
                _o(1, "failed_clean", 11.0, status=503, error="http 503"),
                _o(2, "completed", 12.0, ttft=2.5),
                _o(3, "failed_clean", 13.0, status=429, error="http 429"),  # overload: retry
                _o(4, "aborted", 14.0),  # the client hung up: not judged
                _o(5, "hung", 21.0, error="no end within 120 s"),
                _o(6, "completed", 22.0, ttft=0.3)]
    view = client_view(faults, outcomes)
    assert (view["judged"], view["failures"], view["overloaded_429"]) == (6, 2, 1)
    assert view["failure_rate"] == round(2 / 6, 4)
    assert view["failure_kinds"] == {"http 503": 1, "no end within 120 s": 1}
    by = view["by_fault"]
    assert by["before_faults"] == {"requests": 1, "failures": 0, "ttft_p50_s": 0.1,
                                   "ttft_max_s": 0.1}
    assert by["kill_decode"]["requests"] == 3 and by["kill_decode"]["failures"] == 1
    assert by["kill_decode"]["ttft_max_s"] == 2.5
    assert by["redis_outage"] == {"requests": 2, "failures": 1, "ttft_p50_s": 0.2,
                                  "ttft_max_s": 0.3}


def test_counter_tally_adds_up_across_a_router_restart() -> None:
    def read(moves: float, refused: float, fallback: float, whole: float
             ) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        return {(MOVES, frozenset({("reason", "protocol")})): moves,
                (REFUSED, frozenset({("reason", "limit")})): refused,
                (PATHS, frozenset({("path", "decode_only"), ("reason", "prefill_failed")})):
                    fallback,
                (PATHS, frozenset({("path", "pd"), ("reason", "eligible")})): whole,
                ("pdserve_router_requests_total", frozenset()): 99.0}

    tally = CounterTally()
    tally.add(read(2, 0, 1, 10))
    tally.add(read(5, 1, 1, 20))
    tally.add(read(1, 0, 3, 4))  # restarted: counting began again
    assert tally.summary() == {"moves": {"protocol": 6}, "moves_refused": {"limit": 1},
                               "fallbacks": {"decode_only/prefill_failed": 4}}
