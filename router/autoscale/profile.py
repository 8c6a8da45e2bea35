"""The instance profile: what one prefill and one decode instance cost, and its file format.

One model for everything that sizes or simulates instances: the simulator charges these times
(``bench.sim.engine``), the autoscaler's capacity models (:mod:`router.autoscale.capacity`)
plan with them, and ``pdserve bench profile`` measures them.

Defaults (an 8B dense model in bf16 on one H100/A100-class GPU, rounded from public
measurements: prefill runs at roughly 8-12k tokens/s, a decode step of a moderate batch takes
~15-30 ms; DualMap's authors measured 1.6e-4 s/token prefill for Qwen2.5-7B on Ascend 910B4):
- prefill batch time = ``overhead_s`` (0.02) + ``per_token_s`` (1e-4) x uncached tokens
  + ``cached_token_s`` (0.0) x cached tokens; a batch holds at most ``max_batch_tokens``
  (8192) uncached tokens (one longer prompt runs alone);
- prefix cache: ``cache_blocks`` (20,000 blocks of ``block_tokens`` 16) LRU per prefill instance;
- decode step = ``step_s`` (0.012) + ``per_seq_s`` (1e-4) x batch + ``per_ctx_token_s`` (2e-8)
  x tokens in context; at most ``max_running`` (256) sequences per decode instance;
- KV transfer prefill -> decode: ``kv_transfer_s_per_token`` (5e-6: 128 KiB/token at ~25 GB/s).

The autoscaler plans with these too when it is given no profile (before they were one model,
its own defaults were a 0.005 s prefill overhead, a 0.01 + 0.0005 x batch s decode step and no
KV transfer; the simulator's, documented above, were kept).

File format (schema ``pdserve.bench.profile/1``, what ``pdserve bench profile`` writes)::

    {"schema", "created", "url", "model",                   (optional, not read)
     "prefill": {"fixed_s", "per_token_s", "points": [{"tokens", "ttft_s"}], ...},
     "decode": {"points": [{"batch_size", "step_s"}], "output_tokens", ...}}

``fixed_s`` is the fitted ``overhead_s``; decode ``points`` are fitted to ``step_s`` +
``per_seq_s`` x batch (least squares). Any field above may also be given by name; fields not
given keep their defaults. Older autoscaler profiles spell some fields differently and are
read too (:data:`ALIASES`). Unknown keys, wrong types and negative times are a
:class:`~router.errors.ConfigError` that names the file, the key and what is allowed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from router.errors import ConfigError

PROFILE_SCHEMA = "pdserve.bench.profile/1"


@dataclass(frozen=True)
class PrefillPerf:
    """One prefill instance: batch time, batch size and prefix cache."""

    overhead_s: float = 0.02
    """Fixed time per batch (seconds)."""
    per_token_s: float = 1e-4
    """Time per uncached prompt token (seconds)."""
    cached_token_s: float = 0.0
    """Time per prompt token found in the prefix cache (seconds)."""
    per_token_sq_s: float = 0.0
    """Attention's share of a long prompt (seconds per token squared): computing tokens ``s``
    to ``e`` of a prompt adds this x (e² - s²), so a token costs more the more context it
    attends to (``pdserve bench profile`` fits it when the TTFT curve bends; 0: linear). The
    simulator's colocated engines charge it (:meth:`PathCosts.prefill_s`); ``batch_s`` does
    not."""
    max_batch_tokens: int = 8192
    """Most uncached tokens one batch holds (one longer prompt runs alone)."""
    cache_blocks: int = 20_000
    """Prefix-cache size in blocks (LRU)."""
    block_tokens: int = 16
    """Tokens per KV block."""

    def batch_s(self, uncached: int | float, cached: int | float) -> float:
        """Seconds to prefill a batch of ``uncached`` new and ``cached`` reused tokens."""
        return self.overhead_s + self.per_token_s * uncached + self.cached_token_s * cached

    def scaled(self, factor: float) -> PrefillPerf:
        """The same instance with every time ``factor`` x longer."""
        return replace(self, overhead_s=self.overhead_s * factor,
                       per_token_s=self.per_token_s * factor,
                       cached_token_s=self.cached_token_s * factor,
                       per_token_sq_s=self.per_token_sq_s * factor)


@dataclass(frozen=True)
class DecodePerf:
    """One decode instance: step time, batch room, and the KV transfer into it."""

    step_s: float = 0.012
    """Fixed time per decode step (seconds)."""
    per_seq_s: float = 1e-4
    """Step time per running sequence (seconds)."""
    per_ctx_token_s: float = 2e-8
    """Step time per token in the running sequences' contexts (seconds)."""
    max_running: int = 256
    """Most sequences running at once (KV cache room)."""
    kv_transfer_s_per_token: float = 5e-6
    """KV transfer from the prefill instance per context token (seconds)."""

    def step_time_s(self, batch: int | float, ctx_tokens: int | float) -> float:
        """Seconds per decode step over ``batch`` sequences holding ``ctx_tokens`` in all."""
        return self.step_s + self.per_seq_s * batch + self.per_ctx_token_s * ctx_tokens

    def scaled(self, factor: float) -> DecodePerf:
        """The same instance with every time ``factor`` x longer."""
        return replace(self, step_s=self.step_s * factor, per_seq_s=self.per_seq_s * factor,
                       per_ctx_token_s=self.per_ctx_token_s * factor,
                       kv_transfer_s_per_token=self.kv_transfer_s_per_token * factor)


@dataclass(frozen=True)
class InstanceProfile:
    """A prefill and a decode instance's performance (see the module doc for the defaults)."""

    prefill: PrefillPerf = field(default_factory=PrefillPerf)
    decode: DecodePerf = field(default_factory=DecodePerf)

    def scaled(self, factor: float) -> InstanceProfile:
        """The same hardware with every time ``factor`` x longer."""
        if not factor > 0:
            raise ConfigError(f"profile scale must be > 0, got {factor}")
        return InstanceProfile(self.prefill.scaled(factor), self.decode.scaled(factor))

    @classmethod
    def from_dict(cls, doc: Any, source: str = "profile") -> InstanceProfile:
        """The profile a parsed profile document describes (``source`` names it in errors)."""
        if not isinstance(doc, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(doc).__name__}")
        unknown = set(doc) - _TOP_KEYS
        if unknown:
            raise ConfigError(f"{source}: unknown keys {sorted(unknown)}; allowed: "
                              f"{', '.join(sorted(_TOP_KEYS))}")
        if doc.get("schema", PROFILE_SCHEMA) != PROFILE_SCHEMA:
            raise ConfigError(f"{source}: schema {doc['schema']!r}; allowed: {PROFILE_SCHEMA}")
        sections = {name: _section(doc, name, source) for name in ("prefill", "decode")}
        moved = sections["prefill"].pop("kv_transfer_s_per_token", None)
        if moved is not None:
            if "kv_transfer_s_per_token" in sections["decode"]:
                raise ConfigError(f"{source}: KV transfer given twice (prefill.kv_s_per_token "
                                  f"and decode.kv_transfer_s_per_token)")
            sections["decode"]["kv_transfer_s_per_token"] = moved
        prefill = _fill(PrefillPerf(), sections["prefill"], f"{source}: prefill")
        decode = _fill(DecodePerf(), sections["decode"], f"{source}: decode")
        return cls(prefill, decode)

    @classmethod
    def load(cls, path: str | Path) -> InstanceProfile:
        """Read a profile file (the format in the module doc)."""
        try:
            doc = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"profile {path}: cannot read: {exc}") from exc
        except ValueError as exc:
            raise ConfigError(f"profile {path}: not JSON: {exc}") from exc
        return cls.from_dict(doc, f"profile {path}")

    def to_dict(self) -> dict[str, Any]:
        """This profile as a document :meth:`from_dict` reads back (every field by name)."""
        return {"schema": PROFILE_SCHEMA,
                "prefill": {f.name: getattr(self.prefill, f.name) for f in fields(PrefillPerf)},
                "decode": {f.name: getattr(self.decode, f.name) for f in fields(DecodePerf)}}


#: Older spellings still read: ``section -> {old name: field name}``. ``fixed_s`` is what
#: ``pdserve bench profile`` writes; the others are the autoscaler's former profile fields.
ALIASES: dict[str, dict[str, str]] = {
    "prefill": {"fixed_s": "overhead_s", "s_per_token": "per_token_s",
                "kv_s_per_token": "kv_transfer_s_per_token"},
    "decode": {"step_base_s": "step_s", "step_per_seq_s": "per_seq_s",
               "max_seqs": "max_running"},
}
_TOP_KEYS = {"schema", "created", "url", "model", "prefill", "decode", "box"}
"""``box``: the machine's speed when profiled (``bench.box_speed``), kept for the reader."""
_RECORDS = {"prefill": {"points"}, "decode": {"points", "output_tokens"}}
"""Measurements kept in the file beside the fitted fields (decode ``points`` are fitted)."""


def _section(doc: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    raw = doc.get(name, {})
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {name} must be an object, got {type(raw).__name__}")
    allowed = ({f.name for f in fields(PrefillPerf if name == "prefill" else DecodePerf)}
               | set(ALIASES[name]) | _RECORDS[name])
    unknown = set(raw) - allowed
    if unknown:
        raise ConfigError(f"{source}: unknown {name} keys {sorted(unknown)}; allowed: "
                          f"{', '.join(sorted(allowed))}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        target = ALIASES[name].get(str(key), str(key))
        if target in out:
            raise ConfigError(f"{source}: {name} gives {target} twice (as {key} too)")
        out[target] = value
    if name == "decode":
        points = out.pop("points", None)
        out.pop("output_tokens", None)
        if points:
            if {"step_s", "per_seq_s"} & set(out):
                raise ConfigError(f"{source}: decode gives both points and step_s/per_seq_s")
            out["step_s"], out["per_seq_s"] = _fit_steps(points, source)
    else:
        out.pop("points", None)
    return out


def _fit_steps(points: Any, source: str) -> tuple[float, float]:
    try:
        xy = [(float(p["batch_size"]), float(p["step_s"])) for p in points]
    except (TypeError, KeyError, ValueError) as exc:
        raise ConfigError(f"{source}: decode points must be a list of "
                          f"{{batch_size, step_s}}: {exc!r}") from exc
    base, per_seq = fit_line(xy)
    return max(base, 0.0), max(per_seq, 1e-9)


_Perf = TypeVar("_Perf", PrefillPerf, DecodePerf)


def _fill(perf: _Perf, values: dict[str, Any], where: str) -> _Perf:
    """``perf`` with ``values`` checked (numbers; counts >= 1, times >= 0) and set."""
    types = {f.name: f.type for f in fields(perf)}
    checked: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}.{key}: expected a number, got {value!r}")
        if types[key] == "int":
            if not (math.isfinite(value) and value == int(value) and value >= 1):
                raise ConfigError(f"{where}.{key}: expected a whole number >= 1, got {value!r}")
            checked[key] = int(value)
        elif math.isfinite(value) and value >= 0:
            checked[key] = float(value)
        else:
            raise ConfigError(f"{where}.{key}: expected a time >= 0, got {value!r}")
    return replace(perf, **checked)


def fit_quadratic(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least-squares ``(a, b, c)`` of ``y = a + b x + c x²`` with every coefficient >= 0:
    the unconstrained fit when it has none negative, else the best fit among those that drop
    the negative terms (``fit_line``, a line through the origin, a constant, ...)."""
    if not points:
        raise ValueError("no points to fit")
    best: tuple[float, tuple[float, float, float]] | None = None
    for terms in ((0, 1, 2), (0, 1), (1, 2), (0, 2), (1,), (2,), (0,)):
        coef = _least_squares(points, terms)
        if coef is None or min(coef) < 0:
            continue
        full = [0.0, 0.0, 0.0]
        for k, v in zip(terms, coef, strict=True):
            full[k] = v
        err = sum((y - full[0] - full[1] * x - full[2] * x * x) ** 2 for x, y in points)
        if best is None or err < best[0] - 1e-18:
            best = (err, (full[0], full[1], full[2]))
    return best[1] if best is not None else (0.0, 0.0, 0.0)


def _least_squares(points: list[tuple[float, float]], terms: tuple[int, ...]
                   ) -> list[float] | None:
    """Coefficients of the powers ``terms`` of x fitted to ``points`` (None: underdetermined)."""
    k = len(terms)
    if len(points) < k:
        return None
    m = [[sum(x ** (i + j) for x, _ in points) for j in terms] for i in terms]
    v = [sum(y * x ** i for x, y in points) for i in terms]
    for col in range(k):  # Gaussian elimination with partial pivoting
        piv = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-30:
            return None
        m[col], m[piv], v[col], v[piv] = m[piv], m[col], v[piv], v[col]
        for r in range(k):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col], strict=True)]
                v[r] -= f * v[col]
    return [v[i] / m[i][i] for i in range(k)]


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
