"""Synthetic BurstGPT-format traces: bursty arrivals, heavy-tailed lengths, sessions.

Parameters (defaults):
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
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterator
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
