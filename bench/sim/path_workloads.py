"""The workloads adaptive disaggregation is measured on (``pdserve sim paths``).

Poisson arrivals at ``rate_rps`` for ``duration_s``; the lengths come from a second random
stream, so a seed gives the same request shapes at every rate (the rate search compares like
with like). Parameters (fixed, so a seed names one trace):

- ``prefill_heavy``: prompts uniform in [1000, 2000] tokens, outputs in [8, 32];
  SLOs TTFT 1.0 s, TPOT 0.05 s;
- ``decode_heavy``: prompts in [100, 200], outputs in [224, 288] (~256); TTFT 1.0 s, TPOT
  0.025 s (tight: a decode batch of ~60 at the default costs);
- ``mix``: each request either of the two, half and half; TTFT 1.0 s, TPOT 0.025 s (the
  decode-heavy requests' SLO, for every request);
- ``switch``: prefill-heavy for 60 s, decode-heavy for 60 s, and so on (240 s, two of each);
  SLOs as ``mix``;
- ``multiturn``: conversation turns in sessions over 20 shared system prompts of 256-1024
  tokens (:mod:`bench.sim.workload`'s prefix model on :func:`bench.synth.iter_gamma_rows` with
  Poisson gaps, every row a turn, a new session with probability 0.25), prompts capped at 4,096
  tokens; TTFT 1.0 s, TPOT 0.05 s.

Single-shot prompts carry no block hashes (nothing to share); multi-turn prompts do.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from bench.sim.workload import SimRequest, WorkloadConfig, build_requests
from bench.synth import iter_gamma_rows

SWITCH_S = 60.0
Shape = Callable[[random.Random, float], tuple[int, int]]
"""(lengths rng, arrival time) -> (prompt tokens, output tokens)."""


def _prefill_heavy(rng: random.Random, t: float) -> tuple[int, int]:
    return rng.randint(1000, 2000), rng.randint(8, 32)


def _decode_heavy(rng: random.Random, t: float) -> tuple[int, int]:
    return rng.randint(100, 200), rng.randint(224, 288)


def _mix(rng: random.Random, t: float) -> tuple[int, int]:
    return (_prefill_heavy if rng.random() < 0.5 else _decode_heavy)(rng, t)


def _switch(rng: random.Random, t: float) -> tuple[int, int]:
    return (_decode_heavy if int(t // SWITCH_S) % 2 else _prefill_heavy)(rng, t)


class SimWorkload(Protocol):
    """What ``pdserve sim paths`` measures a fleet on: a name, an SLO pair, and the requests
    of a rate point (this module's workloads, and the goodput benchmark's own,
    :mod:`bench.sim.bench_workloads`)."""

    @property
    def name(self) -> str: ...

    @property
    def ttft_slo_s(self) -> float: ...

    @property
    def tpot_slo_s(self) -> float: ...

    def requests(self, rate_rps: float, seed: int) -> list[SimRequest]: ...


@dataclass(frozen=True)
class PathWorkload:
    """One workload: its SLOs and how long a run of it lasts."""

    name: str
    ttft_slo_s: float
    tpot_slo_s: float
    duration_s: float
    shape: Shape | None = None
    """Single-shot request lengths; None: the multi-turn prefix model."""

    def requests(self, rate_rps: float, seed: int) -> list[SimRequest]:
        """The trace at ``rate_rps`` for this workload's duration (deterministic per seed)."""
        if rate_rps <= 0:
            raise ValueError(f"rate must be > 0, got {rate_rps}")
        if self.shape is None:
            return _multiturn(rate_rps, seed, self.duration_s)
        arrivals, lengths = random.Random(seed), random.Random(seed + 7919)
        out: list[SimRequest] = []
        t = arrivals.expovariate(rate_rps)
        while t < self.duration_s:
            prompt, output = self.shape(lengths, t)
            out.append(SimRequest(len(out), t, prompt, output, ()))
            t += arrivals.expovariate(rate_rps)
        return out


def _multiturn(rate_rps: float, seed: int, duration_s: float) -> list[SimRequest]:
    rows = itertools.takewhile(
        lambda r: r.timestamp_s < duration_s,
        iter_gamma_rows(10**9, rate_rps, seed, conversation_share=1.0, burstiness=1.0,
                        session_ids=False))
    cfg = WorkloadConfig(system_prompts=20, system_min_tokens=256, system_max_tokens=1024,
                         max_prompt_tokens=4096, continue_p=0.75)
    return build_requests(list(rows), cfg, seed)  # times from the first arrival on

WORKLOADS: dict[str, PathWorkload] = {w.name: w for w in (
    PathWorkload("prefill_heavy", 1.0, 0.05, 120.0, _prefill_heavy),
    PathWorkload("decode_heavy", 1.0, 0.025, 120.0, _decode_heavy),
    PathWorkload("mix", 1.0, 0.025, 120.0, _mix),
    PathWorkload("switch", 1.0, 0.025, 4 * SWITCH_S, _switch),
    PathWorkload("multiturn", 1.0, 0.05, 120.0, None),
)}
"""Every workload by name, in the table's order."""
