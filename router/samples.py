"""Prometheus text samples as plain values (pure: no I/O).

A :data:`Samples` maps ``(sample name, frozenset(labels))`` to a value. The router's worker-load
feed and the autoscaler both read workers' ``/metrics`` this way.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

from prometheus_client.parser import text_string_to_metric_families

Samples = Mapping[tuple[str, frozenset[tuple[str, str]]], float]


def parse_samples(text: str, names: Collection[str] | None = None
                  ) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a Prometheus text exposition, or only those whose sample name is in
    ``names``; raises ValueError on malformed text (of the kept lines, with ``names``).

    vLLM's exposition has some 600 lines (histograms of every latency); the full parse costs
    about 10 ms of the reader's event loop. Keeping the wanted lines first costs well under
    one.
    """
    if names is not None:
        text = only_samples(text, names)
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def only_samples(text: str, names: Collection[str]) -> str:
    """The lines of ``text`` that are samples named in ``names`` or their ``# HELP``/``# TYPE``
    lines (a filter by sample name: a family's other samples and comments go)."""
    if not names:
        return ""
    alternatives = "|".join(re.escape(n) for n in sorted(names))
    pattern = re.compile(rf"^(?:# (?:HELP|TYPE) )?(?:{alternatives})[{{ ].*$", re.MULTILINE)
    kept = pattern.findall(text)
    return "\n".join(kept) + "\n" if kept else ""


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of samples named ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def has(samples: Samples, name: str) -> bool:
    """Whether any sample is named ``name``."""
    return any(n == name for n, _ in samples)
