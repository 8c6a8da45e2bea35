"""`bench profile`: a worker's prefill time per token and decode step time vs batch size.

Prefill: one request at a time (an idle server), ``max_tokens=1``, for each prompt length;
the median TTFT per length is fitted as ``fixed_s + per_token_s * tokens + per_token_sq_s *
tokens²`` (least squares, every term >= 0: attention makes a long prompt's tokens dearer, so
the curve bends past a thousand tokens on CPU; lengths at or past the server's
``max_model_len`` are skipped).
Decode: ``B`` requests started together with short prompts and ``ignore_eos``; the median
inter-token gap of all of them (first ``skip`` gaps dropped) is the step time at batch ``B``.

The output is the instance profile the simulator (``pdserve sim --calibration``) and the
autoscaler (``--profile``) read, :class:`router.autoscale.profile.InstanceProfile`'s format
(schema ``pdserve.bench.profile/1``)::

    {"schema", "created", "url", "model",
     "prefill": {"fixed_s", "per_token_s", "per_token_sq_s", "points": [{"tokens", "ttft_s"}]},
     "decode": {"points": [{"batch_size", "step_s"}], "output_tokens"},
     "box": {"copy_gbps", "loop_mops", "wake_us"}}

``box`` is :mod:`bench.box_speed` read right after the measurement: how fast this machine was
(read by people comparing profiles; the simulator and the autoscaler ignore it).

Parameters (defaults): prompt_lengths=(32, 128, 512, 1024, 2048, 3072),
batch_sizes=(1, 2, 4, 8, 16), repeats=3, decode_tokens=32, decode_prompt_tokens=16, skip=2.
"""

from __future__ import annotations

import datetime as dt
import logging
import statistics
from collections.abc import Sequence
from typing import Any

from bench import box_speed
from bench.client import ClientConfig, RequestSpec, run_open_loop
from bench.prompts import PromptSynthesizer
from router.autoscale.profile import PROFILE_SCHEMA, fit_quadratic

PROMPT_LENGTHS = (32, 128, 512, 1024, 2048, 3072)
"""Prompt lengths profiled by default: past 1,024 tokens too, where attention's square term
shows (this box, tiny model: 78 ms at 1,024 tokens, 192 at 2,048, 343 at 3,072)."""

logger = logging.getLogger(__name__)


async def profile(cfg: ClientConfig, prompts: PromptSynthesizer, *,
                  prompt_lengths: Sequence[int] = PROMPT_LENGTHS,
                  batch_sizes: Sequence[int] = (1, 2, 4, 8, 16), repeats: int = 3,
                  decode_tokens: int = 32, decode_prompt_tokens: int = 16,
                  skip: int = 2) -> dict[str, Any]:
    """Measure and return the profile document."""
    # Warm-up so the first measured request does not pay for lazy initialisation.
    await run_open_loop([RequestSpec(0, 0.0, prompts.prompt(8).text, 8, 2)], cfg)
    prefill_points = []
    for n in prompt_lengths:
        ttfts = []
        for _ in range(repeats):
            p = prompts.prompt(n)  # fresh text each time: no prefix-cache hits
            run = await run_open_loop([RequestSpec(0, 0.0, p.text, p.num_tokens, 1)], cfg)
            r = run.results[0]
            if r.ttft_s is None:
                raise RuntimeError(f"prefill probe of {n} tokens failed: {r.error_type} {r.error}")
            ttfts.append(r.ttft_s)
        prefill_points.append({"tokens": n, "ttft_s": statistics.median(ttfts)})
        logger.info("profile: prefill %d tokens -> %.4f s", n, prefill_points[-1]["ttft_s"])
    decode_points = []
    for b in batch_sizes:
        specs = []
        for i in range(b):
            p = prompts.prompt(decode_prompt_tokens)
            specs.append(RequestSpec(i, 0.0, p.text, p.num_tokens, decode_tokens))
        run = await run_open_loop(specs, cfg)
        gaps = [g for r in run.results for g in r.itl_s[skip:]]
        failed = [r for r in run.results if not r.ok]
        if failed or not gaps:
            raise RuntimeError(f"decode probe at batch {b} failed: "
                               f"{[(r.error_type, r.error) for r in failed][:3]}")
        decode_points.append({"batch_size": b, "step_s": statistics.median(gaps)})
        logger.info("profile: decode batch %d -> %.4f s/step", b, decode_points[-1]["step_s"])
    doc = profile_document(cfg.url, cfg.model, prefill_points, decode_points, decode_tokens)
    doc["box"] = box_speed.measure().as_dict()  # this machine's speed when it was measured
    return doc


def profile_document(url: str, model: str, prefill_points: Sequence[dict[str, float]],
                     decode_points: Sequence[dict[str, float]], decode_tokens: int
                     ) -> dict[str, Any]:
    """The profile of measured ``{"tokens", "ttft_s"}`` prefill and ``{"batch_size",
    "step_s"}`` decode points: prefill fitted to ``fixed_s + per_token_s * tokens +
    per_token_sq_s * tokens²`` (every term >= 0; through the origin from one point); decode
    points kept for the reader to fit."""
    if len(prefill_points) >= 2:
        fixed, per_token, per_token_sq = fit_quadratic(
            [(p["tokens"], p["ttft_s"]) for p in prefill_points])
    else:
        fixed, per_token = 0.0, prefill_points[0]["ttft_s"] / prefill_points[0]["tokens"]
        per_token_sq = 0.0
    return {"schema": PROFILE_SCHEMA,
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "url": url, "model": model,
            "prefill": {"fixed_s": fixed, "per_token_s": per_token,
                        "per_token_sq_s": per_token_sq, "points": list(prefill_points)},
            "decode": {"points": list(decode_points), "output_tokens": decode_tokens}}
