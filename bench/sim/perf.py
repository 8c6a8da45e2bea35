"""Performance models of prefill and decode instances, with defaults and JSON calibration.

Defaults (an 8B dense model in bf16 on one H100/A100-class GPU; rounded from public
measurements: prefill runs at roughly 8-12k tokens/s, a decode step of a moderate batch takes
~15-30 ms; DualMap's authors measured 1.6e-4 s/token prefill for Qwen2.5-7B on Ascend 910B4):
- prefill batch time = ``overhead_s`` (0.02) + ``per_token_s`` (1e-4) x uncached tokens
  + ``cached_token_s`` (0.0) x cached tokens; a batch holds at most ``max_batch_tokens``
  (8192) uncached tokens (one longer prompt runs alone);
- prefix cache: ``cache_blocks`` (20,000 x 16 tokens) LRU per prefill instance;
- decode step = ``step_s`` (0.012) + ``per_seq_s`` (1e-4) x batch + ``per_ctx_token_s`` (2e-8)
  x tokens in context; at most ``max_running`` (256) sequences per decode instance;
- KV transfer: ``kv_transfer_s_per_token`` (5e-6: 128 KiB/token at ~25 GB/s).

Calibration: ``load_calibration(path)`` reads ``{"prefill": {...}, "decode": {...}}`` with any
of the field names above (the harness's measured profile), unknown keys are an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class PrefillPerf:
    """Prefill instance model."""

    overhead_s: float = 0.02
    per_token_s: float = 1e-4
    cached_token_s: float = 0.0
    max_batch_tokens: int = 8192
    cache_blocks: int = 20_000
    block_tokens: int = 16

    def batch_s(self, uncached: int, cached: int) -> float:
        """Seconds to prefill a batch."""
        return self.overhead_s + self.per_token_s * uncached + self.cached_token_s * cached


@dataclass(frozen=True)
class DecodePerf:
    """Decode instance model."""

    step_s: float = 0.012
    per_seq_s: float = 1e-4
    per_ctx_token_s: float = 2e-8
    max_running: int = 256
    kv_transfer_s_per_token: float = 5e-6

    def step_time_s(self, batch: int, ctx_tokens: int) -> float:
        """Seconds per decode step."""
        return self.step_s + self.per_seq_s * batch + self.per_ctx_token_s * ctx_tokens


def load_calibration(path: str | Path, prefill: PrefillPerf | None = None,
                     decode: DecodePerf | None = None) -> tuple[PrefillPerf, DecodePerf]:
    """Override the defaults with a measured profile (JSON)."""
    data: dict[str, Any] = json.loads(Path(path).read_text())
    out_p, out_d = prefill or PrefillPerf(), decode or DecodePerf()
    for section, obj in (("prefill", out_p), ("decode", out_d)):
        values = data.get(section, {})
        allowed = {f.name for f in fields(obj)}
        unknown = set(values) - allowed
        if unknown:
            raise ValueError(f"calibration {path}: unknown {section} keys {sorted(unknown)}; "
                             f"allowed: {sorted(allowed)}")
        if section == "prefill":
            out_p = replace(out_p, **values)
        else:
            out_d = replace(out_d, **values)
    return out_p, out_d
