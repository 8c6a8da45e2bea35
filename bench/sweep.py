"""Rate sweep: the highest offered rate with SLO attainment >= target (DistServe's goodput).

Parameters (defaults):
  rates                 the rates tried first, in ascending order
  target=0.9            attainment a rate must reach to pass
  bisect_steps=4        bisection steps between the highest passing and lowest failing rate
  rel_tol=0.05          stop bisecting when the bracket is narrower than this fraction

The runner is injected (``rate -> summary dict`` with ``slo_attainment``), so the search is the
same against a live server and in the unit tests.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

Runner = Callable[[float], Awaitable[dict[str, Any]]]
TARGET = 0.9
"""The SLO attainment a rate must reach to pass (DistServe's goodput bar)."""


def passes(attainment: float | None, target: float = TARGET) -> bool:
    """Whether a rate point with ``attainment`` (None: not measured) passes."""
    return attainment is not None and attainment >= target


def rate_dir(out: Path, rate: float) -> Path:
    """Where the records of the rate point at ``rate`` go under ``out`` (``rate_R``)."""
    return out / f"rate_{rate:.4g}"


@dataclass
class SweepResult:
    """Every rate tried and the best passing one (None if none passed)."""

    points: list[dict[str, Any]] = field(default_factory=list)
    max_rate: float | None = None
    target: float = 0.9

    def passed(self, rate: float) -> bool:
        return any(p["rate"] == rate and p["passed"] for p in self.points)


class RateSearch:
    """The sweep's search, one verdict at a time: :meth:`next_rate` names the rate to try,
    :meth:`record` takes whether it passed. Several searches can then advance in lockstep,
    one point each in turn (``bench.pd_goodput --interleave``), where :func:`sweep` runs one
    search to its end."""

    def __init__(self, rates: Sequence[float], *, bisect_steps: int = 4,
                 rel_tol: float = 0.05) -> None:
        if not rates:
            raise ValueError("need at least one rate")
        self._listed = sorted(set(rates))
        self._bisect_steps = bisect_steps
        self._rel_tol = rel_tol
        self._bisected = 0
        self.lo: float | None = None
        """The highest rate that passed (the result)."""
        self.hi: float | None = None
        """The lowest rate that failed."""

    def next_rate(self) -> float | None:
        """The next rate to try; None when the search is over: the listed rates in ascending
        order until one fails, then bisection between the highest pass and that failure until
        the bracket is within ``rel_tol`` or ``bisect_steps`` points were bisected."""
        if self.hi is None:
            done = [r for r in self._listed if self.lo is not None and r <= self.lo]
            return self._listed[len(done)] if len(done) < len(self._listed) else None
        if self.lo is None or self._bisected >= self._bisect_steps or \
                (self.hi - self.lo) / self.hi <= self._rel_tol:
            return None
        return (self.lo + self.hi) / 2

    def record(self, rate: float, passed: bool) -> None:
        """``rate`` (the one :meth:`next_rate` named) passed or failed."""
        if self.hi is not None:
            self._bisected += 1
        if passed:
            self.lo = rate
        else:
            self.hi = rate


def lockstep(searches: Mapping[str, RateSearch], run: Callable[[str, float, int], bool]
             ) -> None:
    """Advance every search of ``searches`` (by name) to its end, one point each per step:
    ``run(name, rate, step)`` tries that search's next rate and says whether it passed. Each
    step takes the searches not yet over in their given order, rotated by the step number, so
    no name always goes first."""
    for step in itertools.count():
        due = [(name, rate) for name, search in searches.items()
               if (rate := search.next_rate()) is not None]
        if not due:
            return
        shift = step % len(due)
        for name, rate in due[shift:] + due[:shift]:
            searches[name].record(rate, run(name, rate, step))


async def sweep(run: Runner, rates: Sequence[float], *, target: float = TARGET,
                bisect_steps: int = 4, rel_tol: float = 0.05) -> SweepResult:
    """Try ``rates`` in ascending order (stopping after the first failure), then bisect."""
    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target}")
    search = RateSearch(rates, bisect_steps=bisect_steps, rel_tol=rel_tol)
    result = SweepResult(target=target)
    while (rate := search.next_rate()) is not None:
        summary = await run(rate)
        att = summary.get("slo_attainment")
        ok = passes(att, target)
        logger.info("sweep: rate %.4g req/s -> attainment %s (%s)", rate, att,
                    "pass" if ok else "fail")
        result.points.append({"rate": rate, "slo_attainment": att, "passed": ok,
                              "summary": summary})
        search.record(rate, ok)
    result.max_rate = search.lo
    return result
