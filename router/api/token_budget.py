"""Per-key token-rate limits (security review row 13): token buckets, one per API key and kind.

Parameters (defaults):
- ``prefill_per_min`` = 0 (off): prompt tokens one key may send per minute
  (``--prefill-tokens-per-min-per-key``). A request is charged every prompt token the router
  counted at admission (all prompts of a batch; cached prefixes too: what a key may send
  must not depend on what other keys sent before it).
- ``decode_per_min`` = 0 (off): output tokens one key may ask for per minute
  (``--decode-tokens-per-min-per-key``). A request is charged at admission what it may
  generate: ``max_tokens`` (chat: ``max_completion_tokens``) times its choices and prompts, or
  the router's ``expected_output_tokens`` when it sets no cap; when its answer ends the charge
  is settled (:func:`settled_output`).
- burst: one minute's worth. Each bucket holds at most its per-minute rate and refills
  continuously at rate / 60 per second, so a key that was idle may spend a whole minute's
  budget at once, and no more.

Admission: a request passes when every bucket it draws from holds at least its cost, or the
bucket's capacity for a request larger than a whole minute's budget (then the bucket must be
full, and the charge leaves it in debt: the key waits until it refilled). Otherwise it is
refused, nothing charged, with the seconds until it would pass (``Retry-After``). A key is
the hash of the API key presented (every client shares one key when the router has none).

Pure: the caller passes the clock; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

KINDS = ("prefill_tokens", "decode_tokens")
"""What a refusal ran out of (the ``reason`` label of ``pdserve_router_limited_requests_total``)."""


@dataclass
class TokenBucket:
    """Tokens that may be spent now; refills at ``per_min`` / 60 per second up to ``per_min``."""

    per_min: int
    level: float
    updated_s: float

    @classmethod
    def full(cls, per_min: int, now: float) -> TokenBucket:
        """A bucket holding a whole minute's tokens at ``now``."""
        return cls(per_min, float(per_min), now)

    def _refill(self, now: float) -> None:
        if now > self.updated_s:
            self.level = min(float(self.per_min),
                             self.level + (now - self.updated_s) * self.per_min / 60.0)
            self.updated_s = now

    def wait_s(self, cost: int, now: float) -> float:
        """Seconds from ``now`` until a request costing ``cost`` may be charged (0: now)."""
        self._refill(now)
        need = min(float(cost), float(self.per_min))
        if self.level >= need:
            return 0.0
        return (need - self.level) * 60.0 / self.per_min

    def take(self, cost: int, now: float) -> None:
        """Charge ``cost`` (the level may go below zero: debt)."""
        self._refill(now)
        self.level -= cost

    def give_back(self, tokens: int, now: float) -> None:
        """Return ``tokens`` charged but not used (negative: charge more), up to capacity."""
        self._refill(now)
        self.level = min(float(self.per_min), self.level + tokens)


@dataclass(frozen=True)
class Charge:
    """What one admitted request was charged."""

    key: str
    prefill: int
    decode: int


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused: the bucket that lacked tokens and when to retry."""

    kind: str
    """One of :data:`KINDS`."""
    per_min: int
    cost: int
    retry_after_s: int
    """Whole seconds, at least 1."""


def settled_output(charged: int, reported: int | None, events: int, ok: bool) -> int:
    """The output tokens a finished request is finally charged: the count the worker reported
    (``usage``) when known; else, for an answer that failed, the output events relayed (what
    the client got); else the larger of the admission charge and those events (a stream
    without usage: at least what was seen, at most nothing refunded)."""
    if reported is not None:
        return reported
    return events if not ok else max(charged, events)


class TokenBudgets:
    """Every key's prefill and decode buckets (a rate of 0 turns that kind off)."""

    def __init__(self, prefill_per_min: int, decode_per_min: int,
                 clock: Callable[[], float]) -> None:
        if prefill_per_min < 0 or decode_per_min < 0:
            raise ValueError("token rates must be >= 0")
        self.rates = {"prefill_tokens": prefill_per_min, "decode_tokens": decode_per_min}
        self.clock = clock
        """Monotonic seconds (the caller's clock; tests pass their own)."""
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    @property
    def enabled(self) -> bool:
        """Whether any kind is limited."""
        return any(self.rates.values())

    def _bucket(self, key: str, kind: str, now: float) -> TokenBucket:
        bucket = self._buckets.get((key, kind))
        if bucket is None:
            bucket = self._buckets[(key, kind)] = TokenBucket.full(self.rates[kind], now)
        return bucket

    def admit(self, key: str, prefill: int, decode: int) -> Charge | Refusal:
        """Charge ``key`` for a request of ``prefill`` prompt and ``decode`` output tokens, or
        refuse it (nothing charged) with the longest wait among the buckets that lack tokens."""
        now = self.clock()
        costs = {"prefill_tokens": prefill, "decode_tokens": decode}
        worst, longest = None, 0.0
        for kind, per_min in self.rates.items():
            if not per_min:
                continue
            wait = self._bucket(key, kind, now).wait_s(costs[kind], now)
            if wait > longest:
                worst, longest = kind, wait
        if worst is not None:
            return Refusal(worst, self.rates[worst], costs[worst], max(1, math.ceil(longest)))
        for kind, per_min in self.rates.items():
            if per_min:
                self._bucket(key, kind, now).take(costs[kind], now)
        return Charge(key, prefill if self.rates["prefill_tokens"] else 0,
                      decode if self.rates["decode_tokens"] else 0)

    def settle(self, charge: Charge, decode_used: int) -> None:
        """The request ``charge`` admitted ended having generated ``decode_used`` tokens: its
        decode charge becomes that."""
        if self.rates["decode_tokens"] and decode_used != charge.decode:
            now = self.clock()
            self._bucket(charge.key, "decode_tokens", now).give_back(
                charge.decode - decode_used, now)

    def level(self, key: str, kind: str) -> float:
        """Tokens ``key`` may spend of ``kind`` now (its full rate if it never spent any)."""
        now = self.clock()
        return self._bucket(key, kind, now).level if self.rates[kind] else math.inf
