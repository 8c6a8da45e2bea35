"""docs/metrics.md lists every metric the router exports (its README says the list is there)."""

from __future__ import annotations

from pathlib import Path

from router.metrics import RouterMetrics

DOC = Path(__file__).parents[2] / "docs" / "metrics.md"


def test_every_router_metric_is_documented() -> None:
    text = DOC.read_text()
    names = set()
    for family in RouterMetrics().registry.collect():
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    assert len(names) > 10, names
    missing = sorted(n for n in names if f"`{n}`" not in text and f"`{n}{{" not in text)
    assert missing == [], f"add to {DOC}: {missing}"
