"""Prometheus text samples as plain values (pure: no I/O).

A :data:`Samples` maps ``(sample name, frozenset(labels))`` to a value. The router's worker-load
feed and the autoscaler both read workers' ``/metrics`` this way.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

Samples = Mapping[tuple[str, frozenset[tuple[str, str]]], float]


def parse_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a Prometheus text exposition; raises ValueError on malformed text."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of samples named ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def has(samples: Samples, name: str) -> bool:
    """Whether any sample is named ``name``."""
    return any(n == name for n, _ in samples)
