"""The goodput head-to-head's own workloads in the simulator (``pdserve sim paths --workloads
bench:mix,...``): the very requests a rate point of ``python -m bench.pd_goodput`` replays.

A rate point replays ``point_s`` wall seconds of its workload's trace at the rate
(:func:`bench.goodput_workloads.point_rows`: the same generator, parameters and seed, switching
phases included, scheduled by the replay's own code), so the simulated table and the measured
one differ only by the model of the engines, not by the traffic. Prompts are modelled as the
replay's prompt synthesis sends them (:mod:`bench.prompts`): a conversation turn of a session
(the ``multi_turn`` workload, replayed with sessions) starts with the session's previous prompt
and a stand-in for its answer, unless that history is as long as the turn's prompt (the
replay then drops it); every other prompt shares no block with any other. The replay's clamp
to the model's context (``max_model_len``) is applied the same way.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from bench.goodput_workloads import WORKLOADS as BENCH_WORKLOADS
from bench.goodput_workloads import Workload, point_rows
from bench.sim.workload import SimRequest
from bench.trace import clamp_to_context

PREFIX = "bench:"
"""Name prefix of these workloads among ``pdserve sim paths``' workloads."""
TINY_MODEL_LEN = 4096
"""The context of the benchmark's tiny model: the replay's clamp."""


@dataclass(frozen=True)
class BenchWorkload:
    """One ``bench.pd_goodput`` workload as a ``pdserve sim paths`` workload."""

    workload: Workload
    point_s: float = 60.0
    """Wall seconds of one rate point (``bench.pd_goodput --point-s``; switching: at least
    its ``min_point_s``)."""
    block_tokens: int = 16
    max_model_len: int = TINY_MODEL_LEN

    @property
    def name(self) -> str:
        """``bench:`` and the benchmark's workload name."""
        return PREFIX + self.workload.name

    @property
    def ttft_slo_s(self) -> float:
        """The benchmark's TTFT SLO of this workload."""
        return self.workload.ttft_slo_s

    @property
    def tpot_slo_s(self) -> float:
        """The benchmark's TPOT SLO of this workload."""
        return self.workload.tpot_slo_s

    @property
    def duration_s(self) -> float:
        """Wall seconds one rate point lasts."""
        return self.workload.point_s(self.point_s)

    def requests(self, rate_rps: float, seed: int) -> list[SimRequest]:
        """The requests of the rate point at ``rate_rps`` for trace ``seed``."""
        if rate_rps <= 0:
            raise ValueError(f"rate must be > 0, got {rate_rps}")
        fresh = itertools.count(1)
        # session id -> (history tokens, their full blocks' hashes)
        sessions: dict[str, tuple[int, tuple[int, ...]]] = {}
        out: list[SimRequest] = []
        for at_s, row in point_rows(self.workload, rate_rps, self.duration_s, seed):
            n_in, n_out = clamp_to_context(row.request_tokens, row.response_tokens,
                                           self.max_model_len)
            session = row.session_id if self.workload.sessions \
                and row.log_type.lower().startswith("conv") else None
            shared: tuple[int, ...] = ()
            if session is not None and session in sessions:
                history, hashes = sessions[session]
                if history < n_in:
                    shared = hashes
            blocks = shared + tuple(next(fresh) for _ in range(
                n_in // self.block_tokens - len(shared)))
            if session is not None:
                whole = (n_in + n_out) // self.block_tokens
                sessions[session] = (n_in + n_out, blocks + tuple(
                    next(fresh) for _ in range(whole - len(blocks))))
            out.append(SimRequest(len(out), at_s, n_in, n_out,
                                  blocks if self.workload.sessions else ()))
        return out


def bench_workloads(point_s: float = 60.0) -> dict[str, BenchWorkload]:
    """Every ``bench.pd_goodput`` workload by its simulator name (``bench:<name>``)."""
    return {w.name: w for w in (BenchWorkload(b, point_s) for b in BENCH_WORKLOADS.values())}
