"""Read Prometheus text from a real server's /metrics."""

from __future__ import annotations

import httpx

from router.samples import Samples, parse_samples, total


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """All samples at ``url``/metrics keyed by (sample name, labels)."""
    return parse_samples(httpx.get(f"{url}/metrics", timeout=10).text)


def value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``; 0 if none."""
    return total(samples, name, **labels)
