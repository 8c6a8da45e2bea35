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

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

Runner = Callable[[float], Awaitable[dict[str, Any]]]


@dataclass
class SweepResult:
    """Every rate tried and the best passing one (None if none passed)."""

    points: list[dict[str, Any]] = field(default_factory=list)
    max_rate: float | None = None
    target: float = 0.9

    def passed(self, rate: float) -> bool:
        return any(p["rate"] == rate and p["passed"] for p in self.points)


async def sweep(run: Runner, rates: Sequence[float], *, target: float = 0.9,
                bisect_steps: int = 4, rel_tol: float = 0.05) -> SweepResult:
    """Try ``rates`` in ascending order (stopping after the first failure), then bisect."""
    if not rates:
        raise ValueError("need at least one rate")
    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target}")
    result = SweepResult(target=target)

    async def attempt(rate: float) -> bool:
        summary = await run(rate)
        att = summary.get("slo_attainment")
        ok = att is not None and att >= target
        logger.info("sweep: rate %.4g req/s -> attainment %s (%s)", rate, att,
                    "pass" if ok else "fail")
        result.points.append({"rate": rate, "slo_attainment": att, "passed": ok,
                              "summary": summary})
        return ok

    lo: float | None = None
    hi: float | None = None
    for rate in sorted(set(rates)):
        if await attempt(rate):
            lo = rate
        else:
            hi = rate
            break
    if lo is not None and hi is not None:
        for _ in range(bisect_steps):
            if (hi - lo) / hi <= rel_tol:
                break
            mid = (lo + hi) / 2
            if await attempt(mid):
                lo = mid
            else:
                hi = mid
    result.max_rate = lo
    return result
