"""Read Prometheus text from a real server's /metrics."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """All samples at ``url``/metrics keyed by (sample name, labels)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``; 0 if none."""
    total = 0.0
    for (sample_name, sample_labels), v in samples.items():
        if sample_name == name and set(labels.items()) <= sample_labels:
            total += v
    return total
