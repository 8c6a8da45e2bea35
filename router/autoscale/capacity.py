"""Capacity models: how much load one instance sustains within its SLO (pure).

Prefill (an M/D/1 queue per instance, as in DistServe): a request of ``isl`` uncached tokens
takes ``D = isl * s_per_token + overhead_s``; at utilisation ``rho`` the mean TTFT is
``D + rho * D / (2 * (1 - rho))``. Keeping it within ``ttft_slo_s`` gives
``rho_max = 2 * (S - D) / (2 * S - D)`` and a capacity of ``rho_max / s_per_token`` tokens/s.

Decode: one engine step over ``b`` running sequences takes ``step_base_s + step_per_seq_s * b``.
Keeping it within ``tpot_slo_s`` allows ``b_max = floor((S - base) / per_seq)`` sequences,
capped at ``max_seqs`` (KV cache room).

Both come from a profile (``pdserve bench profile`` writes it) and are corrected online by the
planner's observed/predicted latency ratio.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PrefillModel:
    """Prefill cost per uncached token (seconds) plus a fixed per-request overhead."""

    s_per_token: float = 1e-4
    overhead_s: float = 0.005

    def request_s(self, isl: float) -> float:
        """Service time of one prefill of ``isl`` uncached tokens."""
        return self.overhead_s + isl * self.s_per_token

    def tokens_per_s(self, isl: float, ttft_slo_s: float) -> float:
        """Uncached tokens/s one instance sustains with mean TTFT within ``ttft_slo_s``."""
        d = self.request_s(isl)
        if d >= ttft_slo_s:
            return 0.0
        rho_max = 2 * (ttft_slo_s - d) / (2 * ttft_slo_s - d)
        return rho_max / self.s_per_token

    def mean_ttft_s(self, isl: float, tokens_per_s: float) -> float:
        """Predicted mean TTFT on one instance offered ``tokens_per_s`` uncached tokens/s."""
        d = self.request_s(isl)
        rho = min(0.999, tokens_per_s * self.s_per_token)
        return d + rho * d / (2 * (1 - rho))


@dataclass(frozen=True)
class DecodeModel:
    """Decode step time as a linear function of the running batch."""

    step_base_s: float = 0.01
    step_per_seq_s: float = 0.0005
    max_seqs: int = 256

    def step_s(self, batch: float) -> float:
        """Time of one decode step over ``batch`` sequences (the TPOT they all see)."""
        return self.step_base_s + self.step_per_seq_s * batch

    def max_batch(self, tpot_slo_s: float) -> int:
        """Most sequences one instance runs with TPOT within ``tpot_slo_s``."""
        if self.step_per_seq_s <= 0:
            return self.max_seqs
        return max(0, min(self.max_seqs,
                          math.floor((tpot_slo_s - self.step_base_s) / self.step_per_seq_s)))


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of y over x; a flat line through one point."""
    if not points:
        raise ValueError("no points to fit")
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return my, 0.0
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


def load_profile(path: str | Path) -> tuple[PrefillModel, DecodeModel]:
    """Read a profile JSON: the one `pdserve bench profile` writes (``fixed_s``/``per_token_s``
    and decode ``points``), or explicit model fields (``s_per_token``, ``step_base_s`` ...)."""
    doc = json.loads(Path(path).read_text())
    p, d = doc.get("prefill", {}), doc.get("decode", {})
    s_per_token = p.get("s_per_token", p.get("per_token_s", PrefillModel.s_per_token))
    overhead = p.get("overhead_s", p.get("fixed_s", PrefillModel.overhead_s))
    prefill = PrefillModel(float(s_per_token), float(overhead))
    if "points" in d and d["points"]:
        base, per_seq = fit_line([(float(pt["batch_size"]), float(pt["step_s"]))
                                  for pt in d["points"]])
        decode = DecodeModel(max(base, 0.0), max(per_seq, 1e-9),
                             int(d.get("max_seqs", DecodeModel.max_seqs)))
    else:
        decode = DecodeModel(float(d.get("step_base_s", DecodeModel.step_base_s)),
                             float(d.get("step_per_seq_s", DecodeModel.step_per_seq_s)),
                             int(d.get("max_seqs", DecodeModel.max_seqs)))
    return prefill, decode
