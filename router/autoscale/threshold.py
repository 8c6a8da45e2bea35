"""Reactive utilisation-threshold autoscaler (Kubernetes HPA semantics), the baseline (pure).

``desired = ceil(current * utilisation / target)`` unless ``utilisation / target`` is within
``tolerance`` of 1; scale-down waits ``scale_down_cooldown_s`` (HPA's stabilisation window).
Parameters (defaults): target 0.7, tolerance 0.1, scale_down_cooldown_s 300, min 1, max 16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class ThresholdAutoscaler:
    """Sizes one pool from its observed utilisation (busy fraction of its instances)."""

    target: float = 0.7
    tolerance: float = 0.1
    scale_down_cooldown_s: float = 300.0
    min_replicas: int = 1
    max_replicas: int = 16
    _last_change_s: float = field(default=-math.inf, init=False)

    def desired(self, now_s: float, current: int, utilisation: float) -> int:
        """Replicas after observing ``utilisation`` (0..1 per instance, mean) at ``now_s``."""
        ratio = utilisation / self.target
        if abs(ratio - 1.0) <= self.tolerance:
            return current
        want = min(self.max_replicas, max(self.min_replicas, math.ceil(current * ratio)))
        if want < current and now_s - self._last_change_s < self.scale_down_cooldown_s:
            return current
        if want != current:
            self._last_change_s = now_s
        return want
