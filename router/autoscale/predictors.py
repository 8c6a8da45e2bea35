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
