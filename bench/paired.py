"""Two routers on the same requests: is one's attainment or tail really better? (pure)

``bench.routing_real`` replays the same trace (the same prompts at the same send times) through
every router, so each request has a result under both, and two routers can be compared request
by request instead of summary by summary. A 45 s point holds 100-400 requests; a difference of
two or three SLO misses between routers is what the same router shows between two runs, and a
plain ``>`` on two attainments calls it a win.

- Attainment: the exact McNemar test on the requests met by one router and missed by the
  other (the requests both met or both missed say nothing about the difference).
- A TTFT percentile: a paired bootstrap, resampling the requests (each keeps both its results)
  and taking the difference of the two routers' percentiles in every resample.

A router is *behind* on a figure only when the difference is beyond chance at ``alpha``
(two-sided); otherwise the two are *level* on it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from bench.metrics import percentile
from bench.report import read_requests_csv


@dataclass(frozen=True)
class RequestOutcome:
    """One request of a replay: whether it met both SLOs and its TTFT (None: no first token)."""

    met: bool
    ttft_s: float | None


def read_outcomes(requests_csv: Path) -> dict[int, RequestOutcome]:
    """A replay's ``requests.csv`` (``pdserve bench replay``) by request index."""
    return {int(row["index"]): RequestOutcome(met=row["meets_slo"] == "1",
                                              ttft_s=float(row["ttft_s"]) if row["ttft_s"]
                                              else None)
            for row in read_requests_csv(requests_csv)}


def mcnemar_p(only_a: int, only_b: int) -> float:
    """Exact two-sided McNemar p-value: ``only_a`` requests met by A alone, ``only_b`` by B
    alone; under no difference each discordant request is a fair coin."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired_percentile_ci(a: Sequence[float], b: Sequence[float], p: float, *,
                         resamples: int = 2000, level: float = 0.95, seed: int = 0
                         ) -> tuple[float, float, float]:
    """The difference ``percentile(b, p) - percentile(a, p)`` of two paired samples (``a[i]``
    and ``b[i]`` the same request) and its bootstrap confidence interval at ``level``:
    ``(diff, lo, hi)``."""
    if len(a) != len(b) or not a:
        raise ValueError("paired samples must be non-empty and of equal length")
    rng = np.random.default_rng(seed)
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    idx = rng.integers(0, len(xa), size=(resamples, len(xa)))
    diffs = np.percentile(xb[idx], p, axis=1) - np.percentile(xa[idx], p, axis=1)
    tail = (1 - level) / 2 * 100
    return (percentile(xb, p) - percentile(xa, p), percentile(diffs, tail),
            percentile(diffs, 100 - tail))


@dataclass(frozen=True)
class PairedComparison:
    """``ours`` against ``peer`` on the requests both replays hold."""

    requests: int
    only_ours_met: int
    only_peer_met: int
    attainment_p: float
    ttft_p99_diff_s: float
    """ours minus peer: > 0 means ours has the longer tail"""
    ttft_p99_ci_s: tuple[float, float]

    def behind(self, alpha: float = 0.05) -> list[str]:
        """The figures on which ours is behind the peer beyond chance."""
        out = []
        if self.only_peer_met > self.only_ours_met and self.attainment_p < alpha:
            out.append("attainment")
        if self.ttft_p99_ci_s[0] > 0:
            out.append("TTFT p99")
        return out

    def ahead(self, alpha: float = 0.05) -> list[str]:
        """The figures on which ours is ahead of the peer beyond chance."""
        out = []
        if self.only_ours_met > self.only_peer_met and self.attainment_p < alpha:
            out.append("attainment")
        if self.ttft_p99_ci_s[1] < 0:
            out.append("TTFT p99")
        return out


K = TypeVar("K", bound=Hashable)


def compare(ours: Mapping[K, RequestOutcome], peer: Mapping[K, RequestOutcome], *,
            seed: int = 0, alpha: float = 0.05) -> PairedComparison:
    """Pair two replays of one trace by request key (its index; (round, index) for rounds
    pooled). A request without a first token counts
    as :data:`FAILED_TTFT_S` (it is in the tail), so failures are not silently dropped."""
    common = [k for k in ours if k in peer]
    if not common:
        raise ValueError("the two replays share no request")
    only_ours = sum(1 for i in common if ours[i].met and not peer[i].met)
    only_peer = sum(1 for i in common if peer[i].met and not ours[i].met)
    a = [_ttft(peer[i]) for i in common]
    b = [_ttft(ours[i]) for i in common]
    diff, lo, hi = paired_percentile_ci(a, b, 99, level=1 - alpha, seed=seed)
    return PairedComparison(len(common), only_ours, only_peer, mcnemar_p(only_ours, only_peer),
                            diff, (lo, hi))


FAILED_TTFT_S = 1e6
"""The TTFT a request without a first token counts as: past any real one, and finite, so
percentiles over it stay numbers."""


def _ttft(r: RequestOutcome) -> float:
    return FAILED_TTFT_S if r.ttft_s is None else r.ttft_s
