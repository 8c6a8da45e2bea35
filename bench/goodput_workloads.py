"""The workload family of the goodput head-to-head (``python -m bench.pd_goodput``).

Each workload is a BurstGPT-shaped trace (``pdserve bench synth``) with its own SLO pair:

  prefill_heavy  long prompts (median 1,500 tokens), short answers (median 12): TTFT 2 s,
                 TPOT 50 ms. A colocated engine's prefills stall few tokens each, P/D's pay off
                 only if the decode stall per token matters.
  decode_heavy   short prompts (median 150), long answers (median 160), a tight TPOT SLO
                 (25 ms): decode batches dominate.
  mix            the README's original: 1,000-token prompts, 64-token answers, TTFT 1 s,
                 TPOT 50 ms.
  switching      prefill_heavy and decode_heavy phases alternating every ``phase_s`` (15 s) of
                 wall time at every rate, under one SLO pair (TTFT 2 s, TPOT 25 ms); each rate
                 point lasts at least ``min_point_s`` (60 s: four phases).
  multi_turn     800-token prompts, 64-token answers, 80 % conversation turns (shared prefixes):
                 TTFT 1 s, TPOT 50 ms.
"""

from __future__ import annotations

import tempfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.synth import SynthConfig, synth_rows
from bench.trace import TraceRow, read_trace, schedule, write_trace


@dataclass(frozen=True)
class Workload:
    """One trace shape and the SLOs it is judged by."""

    name: str
    prompt_median: float
    response_median: float
    ttft_slo_s: float
    tpot_slo_s: float
    max_prompt_tokens: int = 3000
    max_response_tokens: int = 256
    conversation_fraction: float = 0.0
    sessions: bool = False
    """Replay conversation turns with their earlier turns (shared prefixes)."""
    phases: tuple[str, ...] = ()
    """Workload names whose traces alternate (switching); empty: this one's own trace."""
    phase_s: float = 15.0
    """Wall seconds each phase of a switching trace lasts, whatever the replay rate."""
    min_point_s: float = 0.0
    """The shortest replay a rate point of this workload may have (switching: every phase
    twice)."""

    def point_s(self, wanted_s: float) -> float:
        """How long a rate point of this workload lasts when ``wanted_s`` is asked for."""
        return max(wanted_s, self.min_point_s)


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("prefill_heavy", 1500, 12, 2.0, 0.05, max_response_tokens=32),
    Workload("decode_heavy", 150, 160, 1.0, 0.025, max_prompt_tokens=400),
    Workload("mix", 1000, 64, 1.0, 0.05, max_prompt_tokens=2500, max_response_tokens=192),
    Workload("switching", 0, 0, 2.0, 0.025, phases=("prefill_heavy", "decode_heavy"),
             min_point_s=60.0),
    Workload("multi_turn", 800, 64, 1.0, 0.05, max_prompt_tokens=2500,
             max_response_tokens=192, conversation_fraction=0.8, sessions=True),
)}
"""Every workload by name."""


def synth_config(workload: Workload, duration_s: float, seed: int) -> SynthConfig:
    """The ``pdserve bench synth`` settings of ``workload``'s trace: ``duration_s`` seconds at
    1 req/s (a replay's ``--rate`` compresses it), bursty arrivals, its length medians and
    caps."""
    return SynthConfig(duration_s=duration_s, rate=1.0,
                       prompt_median=workload.prompt_median,
                       response_median=workload.response_median,
                       max_prompt_tokens=workload.max_prompt_tokens,
                       max_response_tokens=workload.max_response_tokens,
                       conversation_fraction=workload.conversation_fraction, seed=seed)


def _synth(workload: Workload, out: Path, duration_s: float, seed: int) -> None:
    """What ``pdserve bench synth`` writes for :func:`synth_config` (in process)."""
    write_trace(synth_rows(synth_config(workload, duration_s, seed)), out,
                layout="v2" if workload.sessions else "v1")


def alternate(traces: Sequence[list[TraceRow]], phases: int, duration_s: float
              ) -> list[TraceRow]:
    """Rows of ``traces`` taken in turn, one per phase of ``duration_s / phases`` seconds (each
    phase's rows come from the trace whose turn it is, at their own times)."""
    span = duration_s / phases
    rows: list[TraceRow] = []
    for phase in range(phases):
        source = traces[phase % len(traces)]
        start = source[0].timestamp_s if source else 0.0
        rows += [replace(r, timestamp_s=r.timestamp_s - start) for r in source
                 if phase * span <= r.timestamp_s - start < (phase + 1) * span]
    return sorted(rows, key=lambda r: r.timestamp_s)


def phase_count(workload: Workload, span_s: float) -> int:
    """Phases of a switching trace replayed over ``span_s`` wall seconds (at least 2)."""
    return max(2, round(span_s / workload.phase_s))


def build_trace(workload: Workload, out: Path, duration_s: float, seed: int,
                phases: int = 4) -> Path:
    """Write ``workload``'s trace (``duration_s`` seconds at 1 req/s, so about ``duration_s``
    requests) to ``out``; a switching workload's in ``phases`` alternating phases."""
    if not workload.phases:
        _synth(workload, out, duration_s, seed)
        return out
    parts = []
    for i, name in enumerate(workload.phases):
        part = out.with_name(f"{out.stem}-{name}.csv")
        _synth(WORKLOADS[name], part, duration_s, seed + i)
        parts.append(list(read_trace(part)))
    write_trace(alternate(parts, phases, duration_s), out)
    return out


def rate_point_trace(workload: Workload, out: Path, rate: float, span_s: float, seed: int
                     ) -> Path:
    """The trace one rate point replays: ``span_s`` wall seconds at ``rate`` req/s (so
    ``rate * span_s`` requests; a switching one changing phase every ``phase_s``), written at
    1 req/s for ``pdserve bench replay --rate`` to compress."""
    return build_trace(workload, out, rate * span_s, seed, phase_count(workload, span_s))


def point_rows(workload: Workload, rate: float, span_s: float, seed: int
               ) -> list[tuple[float, TraceRow]]:
    """The requests one rate point replays, each with its send time (s from the point's
    start): :func:`rate_point_trace` written and read back, scheduled at ``rate`` as
    ``pdserve bench replay --rate`` schedules it (the simulator's copy of a real point)."""
    with tempfile.TemporaryDirectory(prefix="pdserve-point-") as tmp:
        trace = rate_point_trace(workload, Path(tmp) / "trace.csv", rate, span_s, seed)
        rows = list(read_trace(trace))
    sched, _ = schedule(rows, rate=rate)
    return [(s.at_s, s.row) for s in sched]


WARMUP = "warmup"
"""The :func:`prompt_seed` key of a setup's discarded warm-up replay."""


def prompt_seed(seed: int, point: float | str) -> int:
    """The prompt-text seed (``pdserve bench replay --seed``) of one replay: rate point
    ``point`` (or :data:`WARMUP`) of the benchmark run with trace seed ``seed``. Every setup
    gets the same prompts at a point, and no two points of a run share them. With one seed for
    every replay, the rows a point shares with the point before it (a longer trace of the same
    seed starts with the shorter one's rows) were sent again word for word, so after the first
    point a setup served mostly prompts its engines had cached, and one that sends a prompt
    back to the engine that saw it gained the most (prefill_heavy at 2.5 req/s, run
    2026-12-01: TTFT p50 0.05 s where the same prompts cold took 0.2-0.3 s). Prefix reuse is
    the workload's own (sessions, shared system prompts), not the benchmark's."""
    key = WARMUP if point == WARMUP else f"{float(point):.6g}"
    return zlib.crc32(f"{seed}:{key}".encode()) & 0x7FFFFFFF


def sustained_rate(runs: Sequence[Mapping[str, Any]]) -> float:
    """A setup's sustained rate over its repeated ``bench.pd_goodput`` runs: the lower of
    their ``max_rate_rps`` (0 when a run passed no rate)."""
    return min(float(r.get("max_rate_rps") or 0.0) for r in runs)
