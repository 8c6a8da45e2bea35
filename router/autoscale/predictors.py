"""Load predictors for the autoscaler (pure: values in, forecasts out).

Parameters (defaults): ``EwmaPredictor.alpha`` 0.5; ``HoltPredictor.alpha`` 0.5 (level) and
``beta`` 0.3 (trend). ``predict(steps)`` forecasts ``steps`` intervals ahead (1 by default; only
Holt's trend makes it matter). Every predictor returns the last value it saw until it has enough
history, and never forecasts below zero.
"""

from __future__ import annotations

from typing import Protocol


class Predictor(Protocol):
    """One time series: ``observe`` each interval's value, ``predict`` the next."""

    def observe(self, value: float) -> None: ...

    def predict(self, steps: float = 1.0) -> float: ...


class LastValuePredictor:
    """Tomorrow looks like today."""

    def __init__(self) -> None:
        self._last = 0.0

    def observe(self, value: float) -> None:
        self._last = value

    def predict(self, steps: float = 1.0) -> float:
        return max(0.0, self._last)


class EwmaPredictor:
    """Exponentially weighted moving average."""

    def __init__(self, alpha: float = 0.5) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._level: float | None = None

    def observe(self, value: float) -> None:
        self._level = value if self._level is None else (
            self.alpha * value + (1 - self.alpha) * self._level)

    def predict(self, steps: float = 1.0) -> float:
        return max(0.0, self._level or 0.0)


class HoltPredictor:
    """Holt's linear trend (double exponential smoothing): follows ramps, not only levels."""

    def __init__(self, alpha: float = 0.5, beta: float = 0.3) -> None:
        if not (0.0 < alpha <= 1.0 and 0.0 <= beta <= 1.0):
            raise ValueError(f"need 0 < alpha <= 1 and 0 <= beta <= 1, got {alpha}, {beta}")
        self.alpha, self.beta = alpha, beta
        self._level: float | None = None
        self._trend = 0.0

    def observe(self, value: float) -> None:
        if self._level is None:
            self._level = value
            return
        previous = self._level
        self._level = self.alpha * value + (1 - self.alpha) * (previous + self._trend)
        self._trend = self.beta * (self._level - previous) + (1 - self.beta) * self._trend

    def predict(self, steps: float = 1.0) -> float:
        if self._level is None:
            return 0.0
        return max(0.0, self._level + steps * self._trend)


PREDICTORS = {"last": LastValuePredictor, "ewma": EwmaPredictor, "holt": HoltPredictor}


def make_predictor(name: str) -> Predictor:
    """A predictor by name (``last``, ``ewma``, ``holt``)."""
    try:
        return PREDICTORS[name]()  # type: ignore[abstract]
    except KeyError:
        raise ValueError(f"unknown predictor {name!r}; allowed: {sorted(PREDICTORS)}") from None


class BurstHeadroom:
    """How far the arrival rate overshoots its forecast within a horizon, learned online.

    Each interval the planner records the rate it saw and the forecast it made. For every past
    interval ``i`` of the last ``window`` ones whose next ``horizon`` intervals are known, the
    overshoot is ``mean(rate[i+1 .. i+horizon]) / forecast[i]`` (a mean over the horizon, not
    a maximum: one noisy interval is the queue model's business, a level shift is this
    one's). :meth:`factor` is a quantile of those overshoots weighted by the rate that
    followed (SLO attainment counts requests, so a burst weighs what it brought), within
    ``[1, cap]``. Sizing for ``forecast * factor`` keeps instances for the bursts this trace has
    shown within a worker's start time, and none for bursts it has not (a smooth trace learns
    a factor near 1).

    Parameters (defaults): ``window`` 90 intervals, ``cap`` 4.0. Until an overshoot is known
    the factor is 1.0 (a cold start is what the planner's panic rule covers).
    """

    def __init__(self, window: int = 90, cap: float = 4.0) -> None:
        if window < 2 or cap < 1.0:
            raise ValueError(f"need window >= 2 and cap >= 1, got {window}, {cap}")
        self.window, self.cap = window, cap
        self._rates: list[float] = []
        self._forecasts: list[float] = []

    def observe(self, rate: float, forecast: float) -> None:
        """This interval's observed rate and the forecast made after seeing it."""
        self._rates.append(max(0.0, rate))
        self._forecasts.append(max(0.0, forecast))
        extra = len(self._rates) - self.window
        if extra > 0:
            del self._rates[:extra], self._forecasts[:extra]

    def overshoots(self, horizon: int) -> list[tuple[float, float]]:
        """Every known ``(overshoot, rate that followed)``; overshoots capped at ``cap``."""
        out = []
        h = max(1, horizon)
        for i in range(len(self._rates) - h):
            after = sum(self._rates[i + 1:i + 1 + h]) / h
            base = self._forecasts[i]
            ratio = (self.cap if after > 0 else 1.0) if base <= 0 else after / base
            out.append((min(self.cap, ratio), after))
        return out

    def rate_quantile(self, horizon: int, quantile: float) -> float:
        """The rate-weighted ``quantile`` of the mean rates over ``horizon`` intervals seen in
        the window: a rate this trace has shown (0 before any is known)."""
        rates = sorted(after for _, after in self.overshoots(horizon))
        weight = sum(rates)
        if weight <= 0:
            return 0.0
        seen = 0.0
        for r in rates:
            seen += r
            if seen >= quantile * weight:
                return r
        return rates[-1]

    def factor(self, horizon: int, quantile: float) -> float:
        """The rate-weighted ``quantile`` of :meth:`overshoots`, at least 1."""
        xs = sorted(self.overshoots(horizon))
        weight = sum(w for _, w in xs)
        if not xs or quantile <= 0 or weight <= 0:
            return 1.0
        seen = 0.0
        for ratio, w in xs:
            seen += w
            if seen >= quantile * weight:
                return max(1.0, ratio)
        return max(1.0, xs[-1][0])
