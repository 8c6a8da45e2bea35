"""Run metrics from recorded per-request timestamps (pure; definitions follow vLLM's bench).

TTFT: send -> first content chunk. E2E: send -> last content chunk. TPOT: (E2E - TTFT) /
(output tokens - 1), for outputs of 2+ tokens. ITL: every gap between consecutive chunks.
Percentiles interpolate linearly (numpy's default), as ``vllm bench serve`` does; which ones
are reported is configurable (``--percentiles``, vLLM's ``--metric-percentiles``).
:func:`percentile` is the one percentile of the package: real runs and the simulator's reports
(``bench.sim``) both use it, so their numbers compare.

SLO attainment: the share of *scheduled* requests that completed with TTFT <= ``slo_ttft_s``
and TPOT <= ``slo_tpot_s`` (an SLO left unset always holds; a one-token output meets any TPOT
SLO; failed requests miss). Goodput: requests meeting both per second of run (vLLM's
``--goodput`` form; the DistServe form, the highest rate with >= 90% attainment, is the sweep's).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # a type only: the simulator imports this module without the HTTP client
    from bench.client import RequestResult

PERCENTILES: tuple[float, ...] = (50, 90, 99)
"""Percentiles every summary reports under our names (``ttft_p99``); reports and ``compare``
read these, so asking for others adds keys and never removes these."""


def percentile_word(p: float) -> str:
    """``99`` -> ``"99"``, ``99.9`` -> ``"99.9"``: the spelling of ``p`` in key names, as
    ``vllm bench serve`` writes it (``p99.9_ttft_ms``)."""
    return str(int(p)) if int(p) == p else str(p)


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``"50,90,99"`` -> ``(50.0, 90.0, 99.0)``; each must be in [0, 100]."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise ValueError(f"percentiles must be comma-separated numbers, got {text!r}") from exc
    if not values or any(not 0.0 <= p <= 100.0 for p in values):
        raise ValueError(f"percentiles must be numbers in [0, 100], got {text!r}")
    return tuple(dict.fromkeys(values))


def percentile(values: Sequence[float] | np.ndarray, p: float, *,
               empty: float | None = None) -> float:
    """The ``p``-th percentile (0..100) of ``values``, linearly interpolated between the two
    nearest ranks: exactly ``numpy.percentile``'s default. No values give ``empty`` when
    given, else ValueError; so does ``p`` outside [0, 100]."""
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile p must be in [0, 100], got {p}")
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        if empty is None:
            raise ValueError("percentile of no values (pass empty= for a default)")
        return empty
    return float(np.percentile(arr, p))


SCHEDULE_LAG_LIMIT_S = 0.01
"""A run whose p99 send lag (actual send minus scheduled time) exceeds this did not keep its
arrival schedule: the client was starved or blocked, so its latencies are not the server's."""


def distribution(values: Sequence[float], percentiles: Sequence[float] = PERCENTILES
                 ) -> dict[str, float | None]:
    """mean and the given percentiles (``p50``...; None when empty)."""
    keys = [f"p{percentile_word(p)}" for p in percentiles]
    if not values:
        return {"mean": None, **dict.fromkeys(keys)}
    arr = np.asarray(values, dtype=float)
    out: dict[str, float | None] = {"mean": float(arr.mean())}
    for key, p in zip(keys, percentiles, strict=True):
        out[key] = percentile(arr, p)
    return out


def meets_slo(r: RequestResult, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
    """True when ``r`` completed within both SLOs."""
    if not r.ok or r.ttft_s is None:
        return False
    if slo_ttft_s is not None and r.ttft_s > slo_ttft_s:
        return False
    tpot = r.tpot_s
    return not (slo_tpot_s is not None and tpot is not None and tpot > slo_tpot_s)


def summarize(results: Sequence[RequestResult], duration_s: float, *,
              slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
              percentiles: Sequence[float] = PERCENTILES) -> dict[str, Any]:
    """Flat summary metrics of one run (seconds, requests, tokens).

    ``percentiles`` are the ones the vLLM-named keys carry (``p99_ttft_ms``); our own keys
    (``ttft_p99``) carry those plus :data:`PERCENTILES`."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    tpot = [t for t in (r.tpot_s for r in ok) if t is not None]
    itl = [g for r in ok for g in r.itl_s]
    lag = [r.lag_s for r in results if r.lag_s == r.lag_s]  # NaN: never sent
    queue = [r.queue_s for r in results if r.lag_s == r.lag_s]
    good = sum(1 for r in results if meets_slo(r, slo_ttft_s, slo_tpot_s))
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)

    def per_s(x: float) -> float | None:
        return x / duration_s if duration_s > 0 else None

    summary: dict[str, Any] = {
        "requests_scheduled": len(results),
        "requests_sent": len(lag),
        "requests_completed": len(ok),
        "requests_failed": len(results) - len(ok),
        "duration_s": duration_s,
        "request_throughput_rps": per_s(len(ok)),
        "output_token_throughput_tps": per_s(out_tokens),
        "total_token_throughput_tps": per_s(in_tokens + out_tokens),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "slo_ttft_s": slo_ttft_s,
        "slo_tpot_s": slo_tpot_s,
        "slo_attainment": good / len(results) if results else None,
        "goodput_rps": per_s(good),
        "errors": dict(sorted(Counter(r.error_type for r in results if not r.ok).items())),
    }
    ours = tuple(dict.fromkeys((*PERCENTILES, *percentiles)))
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e),
                         ("schedule_lag", lag), ("client_queue", queue)):
        for stat, v in distribution(values, ours).items():
            summary[f"{name}_{stat}"] = v
    summary["schedule_lag_max"] = max(lag) if lag else None
    p99_lag = summary["schedule_lag_p99"]
    summary["timing_valid"] = p99_lag is None or p99_lag <= SCHEDULE_LAG_LIMIT_S
    summary.update(vllm_bench_keys(summary, {"ttft": ttft, "tpot": tpot, "itl": itl,
                                             "e2el": e2e}, percentiles))
    return summary


def vllm_bench_keys(summary: dict[str, Any], samples: dict[str, Sequence[float]],
                    percentiles: Sequence[float] = PERCENTILES) -> dict[str, Any]:
    """The names ``vllm bench serve`` writes in its result JSON (milliseconds for latencies),
    so scripts written for it read our runs unchanged."""
    out: dict[str, Any] = {
        "duration": summary["duration_s"], "completed": summary["requests_completed"],
        "failed": summary["requests_failed"],
        "total_input_tokens": summary["input_tokens"],
        "total_output_tokens": summary["output_tokens"],
        "request_throughput": summary["request_throughput_rps"],
        "request_goodput": summary["goodput_rps"] if summary["slo_ttft_s"] is not None or
        summary["slo_tpot_s"] is not None else None,
        "output_throughput": summary["output_token_throughput_tps"],
        "total_token_throughput": summary["total_token_throughput_tps"],
    }
    for name, values in samples.items():
        arr = np.asarray(values, dtype=float) * 1e3
        empty = arr.size == 0
        out[f"mean_{name}_ms"] = None if empty else float(arr.mean())
        out[f"median_{name}_ms"] = None if empty else float(np.median(arr))
        out[f"std_{name}_ms"] = None if empty else float(arr.std())
        for p in percentiles:
            out[f"p{percentile_word(p)}_{name}_ms"] = \
                None if empty else percentile(arr, p)
    return out
