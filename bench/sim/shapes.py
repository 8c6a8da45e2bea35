"""Arrival-rate shapes for autoscaling traces: relative rate (0.1 .. 1.0 of the peak) over a run.

Each shape is ``(duration_s, seed) -> knots``, knots being ``(time_s, relative_rate)`` points
that ``bench.synth.iter_varying_rows`` interpolates linearly (a 1 s knot pair is a
step). Every shape opens with a quiet minute at 0.1 (the autoscalers start from 1 + 1; a trace
opening at its peak would measure a cold start, not autoscaling). Parameters (fixed, so a seed
names one trace):

- ``steps``: after the quiet minute, phases of 120 s, each at a level drawn log-uniformly
  from 0.1 .. 1.0; levels change as steps (up to 10x at once).
- ``ramp``: quiet (0.1) for 15 % of the run, linear rise to 1.0 by 45 %, hold to 60 %, fall to
  0.1 by 85 % (issue 5's small-config shape); the seed only changes the arrivals.
- ``diurnal``: one compressed day, ``0.55 - 0.45 cos(2 pi (t / duration + phase))`` with the
  phase drawn in +-0.05 (so the run starts near the trough).
- ``spikes``: a base of 0.1 .. 0.15 with spikes to 0.8 .. 1.0 lasting 45 .. 90 s (10 s rise),
  one every 150 .. 240 s.
- ``burstgpt``: minute-long phases at levels drawn log-uniformly from 0.1 .. 1.0 (issue 14's
  unseen trace: the rate changes up to 10x between minute-long phases); the trace generator
  draws its gaps from gamma(0.35) instead of gamma(0.5), burstier within a phase as well.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

Knots = list[tuple[float, float]]
LOW, HIGH = 0.1, 1.0
EDGE_S = 1.0  # a "step" rises within this long
QUIET_S = 60.0  # every shape opens at LOW this long: the autoscalers start from 1 + 1


def _log_uniform(rng: random.Random, lo: float = LOW, hi: float = HIGH) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _phases(duration_s: float, seed: int, phase_s: float) -> Knots:
    rng = random.Random(seed)
    knots: Knots = [(0.0, LOW), (QUIET_S, LOW)]
    t = QUIET_S
    while t < duration_s:
        level = _log_uniform(rng)
        end = min(duration_s, t + phase_s)
        knots += [(t + EDGE_S, level), (end, level)]
        t = end
    return knots


def steps(duration_s: float, seed: int) -> Knots:
    """Two-minute phases at random levels (steps between them)."""
    return _phases(duration_s, seed, 120.0)


def ramp(duration_s: float, seed: int) -> Knots:
    """Quiet, a slow rise to the peak, a hold, a slow fall."""
    return [(f * duration_s, r) for f, r in
            ((0.0, 0.1), (0.15, 0.1), (0.45, 1.0), (0.6, 1.0), (0.85, 0.1), (1.0, 0.1))]


def diurnal(duration_s: float, seed: int) -> Knots:
    """One compressed day: a cosine between 0.1 and 1.0."""
    phase = random.Random(seed).uniform(-0.05, 0.05)
    n = 60
    return [(duration_s * i / n,
             0.55 - 0.45 * math.cos(2 * math.pi * (i / n + phase))) for i in range(n + 1)]


def spikes(duration_s: float, seed: int) -> Knots:
    """A low base with short spikes to the peak."""
    rng = random.Random(seed)
    base = rng.uniform(0.1, 0.15)
    knots: Knots = [(0.0, base)]
    t = rng.uniform(QUIET_S, 150.0)
    while t + 100.0 < duration_s:
        top, hold = rng.uniform(0.8, 1.0), rng.uniform(45.0, 90.0)
        knots += [(t, base), (t + 10.0, top), (t + 10.0 + hold, top),
                  (t + 10.0 + hold + EDGE_S, base)]
        t += rng.uniform(150.0, 240.0)
    knots.append((duration_s, base))
    return knots


def burstgpt(duration_s: float, seed: int) -> Knots:
    """Minute-long phases at random levels (up to 10x apart)."""
    return _phases(duration_s, seed, 60.0)


SHAPES: dict[str, Callable[[float, int], Knots]] = {
    "steps": steps, "ramp": ramp, "diurnal": diurnal, "spikes": spikes, "burstgpt": burstgpt}

#: gamma shape of the inter-arrival gaps per shape (below 1 = burstier than Poisson)
BURSTINESS: dict[str, float] = {"burstgpt": 0.35}
DEFAULT_BURSTINESS = 0.5


def knots(shape: str, duration_s: float, seed: int) -> Knots:
    """The relative-rate knots of ``shape``; ``ValueError`` lists the allowed names."""
    try:
        make = SHAPES[shape]
    except KeyError:
        raise ValueError(f"unknown shape {shape!r}; allowed: {', '.join(SHAPES)}") from None
    return make(duration_s, seed)
