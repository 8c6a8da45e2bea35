"""The router settles its heap: what start-up and a tokenizer load allocated is frozen, so the
collector's full passes (which walk every tracked object with the event loop held) skip it."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from router import heap
from router.api.tokenization import TokenizerCache
from serve.tiny_model import build_tiny_model


@pytest.fixture
def thawed() -> Iterator[None]:
    """Nothing frozen before the test, and nothing left frozen after it."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_settle_freezes_what_exists_and_not_what_comes_after(thawed: None) -> None:
    assert gc.get_freeze_count() == 0  # control: a fresh process freezes nothing by itself
    before = [object() for _ in range(1000)] + [[] for _ in range(1000)]  # tracked: the lists
    frozen = heap.settle()
    assert frozen >= 1000 + len(before) // 2
    later = [[] for _ in range(5000)]
    # what requests allocate afterwards is collected as before: not frozen (the count only
    # drifts down, as frozen objects other threads held are freed)
    assert gc.get_freeze_count() <= frozen
    del before, later


def test_each_tokenizer_load_calls_the_hook_once_and_a_failed_load_never(
        tmp_path: Path) -> None:
    calls: list[int] = []
    cache = TokenizerCache(on_loaded=lambda: calls.append(1))
    model_path = str(build_tiny_model())

    async def load() -> None:
        assert await cache.get(str(tmp_path / "missing")) is None  # negative control
        assert calls == []
        assert await cache.get(model_path) is not None
        assert await cache.get(model_path) is not None  # cached: no second load
    asyncio.run(load())
    assert calls == [1]


def test_the_app_settles_after_start_up_and_each_tokenizer_load_only_when_asked(
        thawed: None) -> None:
    """``router.main`` builds its app with ``settle_heap``; any other app (tests, embedders)
    leaves the process's collector alone. The gauge says what was frozen."""
    from router.api.app import create_app
    from router.config import RouterSettings
    from router.state.cluster import StaticCluster

    model_path = str(build_tiny_model())

    async def run(settle: bool) -> tuple[int, int, float]:
        app = create_app(RouterSettings(load_poll_interval_s=0), cluster=StaticCluster([]),
                         settle_heap=settle)
        async with app.router.lifespan_context(app):
            started = gc.get_freeze_count()
            await app.state.router.tokenizers.get(model_path)
            gauge = app.state.router.metrics.registry.get_sample_value(
                "pdserve_router_heap_frozen_objects")
            return started, gc.get_freeze_count(), gauge

    assert asyncio.run(run(False)) == (0, 0, 0.0)  # control: not asked, nothing frozen
    started, loaded, gauge = asyncio.run(run(True))
    # the load's objects were frozen too (a frozen object freed since leaves the count)
    assert 0 < started < loaded <= gauge
