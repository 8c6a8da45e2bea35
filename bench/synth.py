"""Synthetic BurstGPT-format traces: bursty arrivals, heavy-tailed lengths, sessions.

Two generators share this module and :class:`~bench.trace.TraceRow`; each keeps its own random
stream, because published tables depend on the exact rows a seed gives (README: the load tests
on :func:`synth_rows`, the simulator and autoscaling tables on :func:`gamma_rows` and
:func:`iter_varying_rows`), so neither can be rewritten in terms of the other.

:func:`synth_rows` (numpy; ``pdserve bench synth``, the load harness). Parameters (defaults):
  duration_s=600          trace length in seconds
  rate=1.0                mean arrivals per second
  dispersion=4.0          variance/mean of per-second counts (1 = Poisson; >1 bursty). Counts
                          are negative binomial: Poisson with a gamma-distributed rate per second
  prompt_median=600       median request tokens of a first turn (lognormal body)
  prompt_sigma=1.0        lognormal sigma of request tokens
  response_median=250     median response tokens
  response_sigma=0.9      lognormal sigma of response tokens
  max_prompt_tokens=16000, max_response_tokens=4000   clamps of the heavy tail
  conversation_fraction=0.7   share of rows that are "Conversation log" (rest "API log")
  gpt4_fraction=0.3       share of rows with Model "GPT-4" (rest "ChatGPT")
  session_continue=0.5    probability a conversation turn continues an open session
  failure_fraction=0.0    share of rows written as failed (Response tokens = 0)
  seed=0

A continued turn's request tokens are the previous turn's request + response tokens plus a new
user message, the way a chat client resends history, so prompt synthesis can share prefixes.

:func:`gamma_rows` / :func:`iter_gamma_rows` (``random.Random``; the simulator). ``n`` rows;
request tokens ``lognormal(5.6, 0.9)`` in [16, 4096] (a turn's new tokens: the simulator's
workload model adds the session's history), response tokens ``lognormal(5.0, 0.8)`` in [1, 2048].
Parameters (defaults):
  rate_rps=2.0            mean arrivals per second
  seed=0
  conversation_share=0.8  share of "Conversation log" rows (Model ChatGPT; the rest GPT-4 API)
  new_session_p=0.25      probability a conversation turn opens a session (else joins one of
                          the open ones, uniformly)
  burstiness=0.5          gamma shape of the inter-arrival gaps (1 = Poisson; < 1 bursty)
  open_sessions=300       sessions a turn may join (the oldest closes beyond this)
  session_ids=True        False leaves ``session_id`` empty (sessions to the workload model)
:func:`iter_varying_rows` is the same with a rate that follows ``(time_s, rate_rps)`` knots."""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from bench.trace import TraceRow

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SynthConfig:
    """Shape of a synthetic trace (see the module docstring for meanings and defaults)."""

    duration_s: float = 600.0
    rate: float = 1.0
    dispersion: float = 4.0
    prompt_median: float = 600.0
    prompt_sigma: float = 1.0
    response_median: float = 250.0
    response_sigma: float = 0.9
    max_prompt_tokens: int = 16000
    max_response_tokens: int = 4000
    conversation_fraction: float = 0.7
    gpt4_fraction: float = 0.3
    session_continue: float = 0.5
    failure_fraction: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.rate <= 0:
            raise ValueError("duration_s and rate must be > 0")
        if self.dispersion < 1.0:
            raise ValueError(f"dispersion must be >= 1 (1 = Poisson), got {self.dispersion}")
        for name in ("conversation_fraction", "gpt4_fraction", "session_continue",
                     "failure_fraction"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if min(self.max_prompt_tokens, self.max_response_tokens) < 1:
            raise ValueError("max_prompt_tokens and max_response_tokens must be >= 1")


def _lognormal_int(rng: np.random.Generator, median: float, sigma: float, hi: int) -> int:
    return int(min(hi, max(1, round(float(rng.lognormal(np.log(median), sigma))))))


def synth_rows(cfg: SynthConfig) -> Iterator[TraceRow]:
    """Yield rows in time order; deterministic for a given config (seed included)."""
    rng = np.random.default_rng(cfg.seed)
    open_sessions: list[tuple[str, int]] = []  # (session id, context tokens so far)
    next_session = 0
    for second in range(int(np.ceil(cfg.duration_s))):
        lam = cfg.rate
        if cfg.dispersion > 1.0:
            # Poisson(Gamma(k, rate/k)) has variance/mean = 1 + rate/k.
            k = cfg.rate / (cfg.dispersion - 1.0)
            lam = float(rng.gamma(k, cfg.rate / k))
        n = int(rng.poisson(lam))
        for t in sorted(float(x) for x in rng.uniform(second, second + 1.0, n)):
            if t >= cfg.duration_s:
                continue
            model = "GPT-4" if rng.random() < cfg.gpt4_fraction else "ChatGPT"
            response = _lognormal_int(rng, cfg.response_median, cfg.response_sigma,
                                      cfg.max_response_tokens)
            session: str | None = None
            if rng.random() < cfg.conversation_fraction:
                log_type = "Conversation log"
                new = _lognormal_int(rng, cfg.prompt_median, cfg.prompt_sigma,
                                     cfg.max_prompt_tokens)
                if open_sessions and rng.random() < cfg.session_continue:
                    idx = int(rng.integers(len(open_sessions)))
                    session, context = open_sessions[idx]
                    request = context + max(1, new // 4)
                    if request > cfg.max_prompt_tokens:
                        open_sessions.pop(idx)  # a real client would start over too
                        session, request = None, new
                    else:
                        open_sessions[idx] = (session, request + response)
                else:
                    request = new
                if session is None:
                    session = f"s{next_session}"
                    next_session += 1
                    open_sessions.append((session, request + response))
                    if len(open_sessions) > 64:
                        open_sessions.pop(0)
            else:
                log_type = "API log"
                request = _lognormal_int(rng, cfg.prompt_median, cfg.prompt_sigma,
                                         cfg.max_prompt_tokens)
            if cfg.failure_fraction and rng.random() < cfg.failure_fraction:
                response = 0
            elapsed = round(0.2 + 0.02 * response + 0.0002 * request, 3)
            yield TraceRow(round(t, 3), model, request, response, request + response, log_type,
                           session, elapsed)


def fixed_shape_rows(num_requests: int, *, input_tokens: int, output_tokens: int,
                     rate: float = math.inf, seed: int = 0) -> list[TraceRow]:
    """``num_requests`` API-log rows of exactly ``input_tokens`` in / ``output_tokens`` out,
    arriving as a Poisson process of ``rate`` req/s (all at 0 when infinite), the workload of
    ``vllm bench serve --dataset-name random --random-range-ratio 0``: :func:`synth_rows` with
    no spread in lengths, no sessions and no burstiness beyond Poisson."""
    if num_requests < 1 or min(input_tokens, output_tokens) < 1:
        raise ValueError("num_requests, input_tokens and output_tokens must be >= 1")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 (inf: all at once), got {rate}")
    finite = math.isfinite(rate)
    arrival_rate = rate if finite else 1.0
    # Lazy generator: a horizon far beyond the expected span costs nothing unused.
    cfg = SynthConfig(duration_s=10.0 * (num_requests + 10) / arrival_rate, rate=arrival_rate,
                      dispersion=1.0, prompt_median=input_tokens, prompt_sigma=0.0,
                      response_median=output_tokens, response_sigma=0.0,
                      max_prompt_tokens=input_tokens, max_response_tokens=output_tokens,
                      conversation_fraction=0.0, gpt4_fraction=0.0, seed=seed)
    rows = list(itertools.islice(synth_rows(cfg), num_requests))
    if len(rows) < num_requests:
        raise ValueError(f"synthesized only {len(rows)} of {num_requests} arrivals")
    return rows if finite else [replace(r, timestamp_s=0.0) for r in rows]


def gamma_rows(n: int, rate_rps: float = 2.0, seed: int = 0, conversation_share: float = 0.8,
               new_session_p: float = 0.25, burstiness: float = 0.5,
               open_sessions: int = 300) -> list[TraceRow]:
    """``n`` rows of the simulator's trace shape: gamma inter-arrivals (shape ``burstiness``
    < 1 = bursty), log-normal request/response lengths, conversation turns in sessions."""
    return list(iter_gamma_rows(n, rate_rps, seed, conversation_share, new_session_p,
                                burstiness, open_sessions))


def iter_gamma_rows(n: int, rate_rps: float = 2.0, seed: int = 0,
                    conversation_share: float = 0.8, new_session_p: float = 0.25,
                    burstiness: float = 0.5, open_sessions: int = 300,
                    session_ids: bool = True) -> Iterator[TraceRow]:
    """Lazy :func:`gamma_rows`; ``session_ids=False`` leaves sessions to the workload model."""
    rng = random.Random(seed)
    return _gamma(rng, n, lambda t: rng.gammavariate(burstiness, 1.0 / (rate_rps * burstiness)),
                  conversation_share, new_session_p, open_sessions, session_ids)


def knot_value(knots: Sequence[tuple[float, float]], t: float) -> float:
    """The value at ``t`` of ``(time, value)`` knots, linearly interpolated; held flat before
    the first knot and after the last."""
    i = bisect.bisect_right([k[0] for k in knots], t)
    if i == 0:
        return knots[0][1]
    if i >= len(knots):
        return knots[-1][1]
    (t0, v0), (t1, v1) = knots[i - 1], knots[i]
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def iter_varying_rows(knots: Sequence[tuple[float, float]], seed: int = 0,
                      burstiness: float = 0.5, conversation_share: float = 0.8,
                      new_session_p: float = 0.25, open_sessions: int = 300,
                      session_ids: bool = True) -> Iterator[TraceRow]:
    """:func:`iter_gamma_rows` with an arrival rate that changes over time: ``knots`` are
    ``(time_s, rate_rps)`` points, linearly interpolated; the trace ends at the last knot."""
    if len(knots) < 2 or any(b[0] <= a[0] for a, b in zip(knots, knots[1:], strict=False)):
        raise ValueError("need >= 2 knots with increasing times")
    if any(r <= 0 for _, r in knots):
        raise ValueError("knot rates must be > 0")
    rng = random.Random(seed)
    end = knots[-1][0]

    def gap(t: float) -> float:
        # the gap is drawn at the rate of its start: fine while the rate changes slowly
        # compared with the mean gap
        return rng.gammavariate(burstiness, 1.0 / (knot_value(knots, t) * burstiness))

    for row in _gamma(rng, None, gap, conversation_share, new_session_p, open_sessions,
                      session_ids):
        if row.timestamp_s > end:
            return
        yield row


def _gamma(rng: random.Random, n: int | None, gap: Callable[[float], float],
           conversation_share: float, new_session_p: float, open_sessions: int,
           session_ids: bool) -> Iterator[TraceRow]:
    # The draws and their order are the seed's contract (see the module docstring).
    t = 0.0
    sessions: list[str] = []
    next_sid = 0
    for _ in itertools.count() if n is None else range(n):
        t += gap(t)
        req = int(min(max(rng.lognormvariate(5.6, 0.9), 16), 4096))
        resp = int(min(max(rng.lognormvariate(5.0, 0.8), 1), 2048))
        if rng.random() < conversation_share:
            if not sessions or rng.random() < new_session_p:
                sid = f"s{next_sid}"
                next_sid += 1
                sessions.append(sid)
                if len(sessions) > open_sessions:
                    sessions.pop(0)
            else:
                sid = rng.choice(sessions)
            yield TraceRow(t, "ChatGPT", req, resp, req + resp, "Conversation log",
                           sid if session_ids else None)
        else:
            yield TraceRow(t, "GPT-4", req, resp, req + resp, "API log", None)
