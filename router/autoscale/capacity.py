"""Capacity models: how much load one instance sustains within its SLO (pure).

Prefill: each instance is its own G/G/1 queue (a prefix-affinity router such as DualMap sends a
request to the instance holding its prefix, not to a shared queue). A request of ``isl``
uncached tokens takes ``D = overhead_s + isl * per_token_s``; utilisation is ``rho = tokens/s *
per_token_s`` (batching amortises the per-request overhead). The mean wait is
``W = v * rho * D / (1 - rho)`` (Kingman, ``v = variability`` = (arrival CV^2 + service CV^2)
/ 2: 0.5 is DistServe's M/D/1, 1.0 the default; BurstGPT-like bursts and heavy-tailed prompt
lengths measure 2 to 5) and its tail is exponential, ``P(wait > t) = rho * exp(-t * rho / W)``,
so the ``q``-quantile wait is ``W / rho * ln(rho / (1 - q))`` (0 while ``rho <= 1 - q``). TTFT =
``latency_s`` + ``handoff_s`` (outside the prefill queue, below) + ``D`` + wait;
its quantile adds the quantile wait to the service time of the quantile prompt (``tail_isl``:
prompt lengths are heavy-tailed, so at low load the p90 TTFT is the p90 prompt's prefill).
In P/D the TTFT also holds the handoff: the KV transfer of the whole context
(``kv_transfer_s_per_token`` x prompt tokens, cached ones included) and the first decode step at the
decode pool's batch; :meth:`PrefillModel.with_handoff` sets it each interval, so the budget
left for queueing shrinks as decode batches grow and the online fit compares like with like.
Capacity = the largest load whose TTFT (mean, or quantile) stays within the SLO.

Decode: one engine step over ``b`` running sequences takes ``step_base_s + step_per_seq_s * b``.
Keeping it within ``tpot_slo_s`` allows ``b_max = floor((S - base) / per_seq)`` sequences,
capped at ``max_seqs`` (KV cache room); one instance then delivers ``b_max / step(b_max)``
output tokens/s (Dynamo's "throughput per GPU at the ITL target"). Sizing in tokens/s, not in
concurrent sequences, keeps the load independent of the pool's size (the concurrency is not:
fewer instances run bigger batches, slower steps, so each sequence stays longer).

Both read their service times from one :class:`~router.autoscale.profile.InstanceProfile` (the
simulator charges the very same times; ``pdserve bench profile`` measures them): the prefill
model its ``overhead_s``, ``per_token_s`` and KV transfer, the decode model its step at a mean
context of ``context_tokens`` per sequence (``step_s`` + (``per_seq_s`` + ``per_ctx_token_s`` x
context) x batch) and ``max_running``. :func:`capacity_models` builds both. They are fitted
online by the planner: ``scaled(c)`` multiplies the service times, ``with_variability(v)`` sets
the queue's variability, and ``fit_scale`` finds the value of either under which the model
predicts the latency observed at the load offered.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from router.autoscale.profile import InstanceProfile


@dataclass(frozen=True)
class PrefillModel:
    """A prefill instance's TTFT under load: the profile's service time plus the queue (see
    the module doc), the latency outside the queue, and the queue's variability."""

    profile: InstanceProfile
    """Service times: ``prefill`` per request, ``decode.kv_transfer_s_per_token`` per handoff."""
    latency_s: float = 0.0
    """Fixed TTFT outside the prefill queue (network, router)."""
    variability: float = 1.0
    handoff_s: float = 0.0
    """TTFT after the prefill of the current traffic: the KV transfer plus the first decode
    step (set by :meth:`with_handoff`)."""

    @property
    def per_token_s(self) -> float:
        """Prefill time per uncached token."""
        return self.profile.prefill.per_token_s

    @property
    def kv_s_per_token(self) -> float:
        """KV transfer to the decode worker per prompt token (cached ones too: the whole
        context moves)."""
        return self.profile.decode.kv_transfer_s_per_token

    def scaled(self, factor: float) -> PrefillModel:
        """The same instance with every prefill ``factor`` x slower."""
        return replace(self, profile=replace(self.profile,
                                             prefill=self.profile.prefill.scaled(factor)))

    def with_variability(self, variability: float) -> PrefillModel:
        """The same instance under traffic of another ``variability``."""
        return replace(self, variability=variability)

    def with_handoff(self, context_tokens: float, first_step_s: float) -> PrefillModel:
        """The same instance whose requests carry ``context_tokens`` of KV to a decode worker
        and then wait ``first_step_s`` for its first step: both are part of the TTFT."""
        return replace(self, handoff_s=self.kv_s_per_token * max(0.0, context_tokens)
                       + max(0.0, first_step_s))

    @property
    def outside_s(self) -> float:
        """TTFT outside the prefill queue and service: fixed latency plus the handoff."""
        return self.latency_s + self.handoff_s

    def request_s(self, isl: float) -> float:
        """Service time of one prefill of ``isl`` uncached tokens."""
        return self.profile.prefill.batch_s(isl, 0)

    def ttft_s(self, isl: float, tokens_per_s: float, quantile: float | None = None,
               tail_isl: float | None = None) -> float:
        """Predicted TTFT (mean, or its ``quantile``) of an instance offered ``tokens_per_s``
        uncached tokens/s in requests of ``isl`` tokens on average (``tail_isl`` at the
        quantile; default ``isl``)."""
        rho = min(0.999, tokens_per_s * self.per_token_s)
        return self._ttft(self.request_s(isl), rho, quantile,
                          self.request_s(max(isl, tail_isl or isl)))

    def queue_wait_s(self, isl: float, tokens_per_s: float, quantile: float | None = None
                     ) -> float:
        """The queueing part of :meth:`ttft_s` (mean, or its ``quantile``)."""
        d = self.request_s(isl)
        return self._ttft(d, min(0.999, tokens_per_s * self.per_token_s), quantile, d) \
            - self.outside_s - d

    def mean_ttft_s(self, isl: float, tokens_per_s: float) -> float:
        """Predicted mean TTFT of an instance offered ``tokens_per_s`` uncached tokens/s."""
        return self.ttft_s(isl, tokens_per_s)

    def tokens_per_s(self, isl: float, ttft_slo_s: float, quantile: float | None = None,
                     tail_isl: float | None = None) -> float:
        """Uncached tokens/s one instance sustains with its TTFT (mean, or ``quantile``, see
        :meth:`ttft_s`) within ``ttft_slo_s``."""
        d, budget = self.request_s(isl), ttft_slo_s - self.outside_s
        d_tail = self.request_s(max(isl, tail_isl or isl)) if quantile is not None else d
        if d_tail >= budget:
            return 0.0
        if quantile is None:  # closed form: rho/(1-rho) <= (S-L-D)/(v D)
            k = (budget - d) / (self.variability * d) if self.variability > 0 else math.inf
            return (1.0 if math.isinf(k) else k / (1 + k)) / self.per_token_s
        lo, hi = 0.0, 0.999  # the TTFT grows with rho: bisect for the largest rho within SLO
        if self._ttft(d, hi, quantile, d_tail) <= ttft_slo_s:
            return hi / self.per_token_s
        for _ in range(40):
            mid = (lo + hi) / 2
            if self._ttft(d, mid, quantile, d_tail) <= ttft_slo_s:
                lo = mid
            else:
                hi = mid
        return lo / self.per_token_s

    def _ttft(self, d: float, rho: float, quantile: float | None, d_tail: float) -> float:
        if rho <= 0:
            return self.outside_s + (d if quantile is None else d_tail)
        scale = self.variability * d / (1 - rho)  # mean wait of those who wait
        if quantile is None:
            return self.outside_s + d + rho * scale
        wait = scale * math.log(rho / (1 - quantile)) if rho > 1 - quantile else 0.0
        return self.outside_s + d_tail + wait


@dataclass(frozen=True)
class DecodeModel:
    """Decode step time as a linear function of the running batch: the profile's step at
    ``context_tokens`` per sequence, times ``scale``."""

    profile: InstanceProfile
    context_tokens: float = 0.0
    """Mean context per running sequence (prompt plus output so far)."""
    scale: float = 1.0
    """The online fit's factor on the profile's step times."""

    @property
    def step_base_s(self) -> float:
        """Step time of an empty batch."""
        return self.profile.decode.step_s * self.scale

    @property
    def step_per_seq_s(self) -> float:
        """Step time per running sequence, its context included."""
        d = self.profile.decode
        return (d.per_seq_s + d.per_ctx_token_s * self.context_tokens) * self.scale

    @property
    def max_seqs(self) -> int:
        """Most sequences one instance runs (KV cache room)."""
        return self.profile.decode.max_running

    def scaled(self, factor: float) -> DecodeModel:
        """The same instance with every decode step ``factor`` x slower."""
        return replace(self, scale=self.scale * factor)

    def step_s(self, batch: float) -> float:
        """Time of one decode step over ``batch`` sequences (the TPOT they all see)."""
        return self.step_base_s + self.step_per_seq_s * batch

    def tokens_per_s(self, tpot_slo_s: float) -> float:
        """Output tokens/s one instance delivers with its step time within ``tpot_slo_s``."""
        b = self.max_batch(tpot_slo_s)
        return b / self.step_s(b) if b > 0 else 0.0

    def tpot_s(self, tokens_per_s: float) -> float:
        """Step time of one instance delivering ``tokens_per_s`` output tokens/s: the batch
        ``b`` with ``b / step(b)`` = that rate (the largest batch's step once out of room)."""
        b_cap = float(self.max_seqs)
        x = tokens_per_s
        if x * self.step_per_seq_s >= 1.0:
            return self.step_s(b_cap)
        return self.step_s(min(b_cap, x * self.step_base_s / (1.0 - x * self.step_per_seq_s)))

    def max_batch(self, tpot_slo_s: float) -> int:
        """Most sequences one instance runs with TPOT within ``tpot_slo_s``."""
        if self.step_per_seq_s <= 0:
            return self.max_seqs
        return max(0, min(self.max_seqs,
                          math.floor((tpot_slo_s - self.step_base_s) / self.step_per_seq_s)))


def fit_scale(latency_at: Callable[[float], float], observed_s: float,
              bounds: tuple[float, float]) -> float:
    """The service-time scale within ``bounds`` at which ``latency_at(scale)`` (increasing in
    it) equals ``observed_s``; the nearer bound when none does (bisection in log space)."""
    lo, hi = bounds
    if latency_at(lo) >= observed_s:
        return lo
    if latency_at(hi) <= observed_s:
        return hi
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        if latency_at(mid) <= observed_s:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def capacity_models(profile: InstanceProfile, context_tokens: float = 0.0
                    ) -> tuple[PrefillModel, DecodeModel]:
    """The prefill and decode capacity models of ``profile``'s instances, decode sequences
    holding ``context_tokens`` of context on average."""
    return PrefillModel(profile), DecodeModel(profile, context_tokens)
