"""JSON on the relay's hot path: orjson, with the standard library for what orjson refuses.

Every streamed event the router relays is decoded (token ids, usage, gaps) and some are encoded
again; orjson does both several times faster than :mod:`json`. Results are the same: ``loads``
falls back to :func:`json.loads` for the JSON orjson rejects (``NaN``, integers beyond 64 bits,
lone surrogate escapes) and ``dumps`` to ``json.dumps(ensure_ascii=False, separators=(",",
":"))`` for what it cannot encode (lone surrogates, non-string keys); both write compact JSON
with the same keys in the same order and non-ASCII text as UTF-8. Floats may be spelled
differently (``1e-05`` vs ``1e-5``): the same number.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def loads(raw: bytes | str) -> Any:
    """Decode JSON (``ValueError`` when it is not JSON)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def dumps(data: Any) -> bytes:
    """Compact UTF-8 JSON of ``data``."""
    try:
        return orjson.dumps(data)
    except TypeError:  # orjson.JSONEncodeError: lone surrogates, non-str keys, big ints
        return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
