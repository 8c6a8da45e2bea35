"""Which cores each engine runs on: the cluster plan and a worker's --cpus (pure)."""

from __future__ import annotations

import pytest

from serve.cpu_layout import plan_cpus, worker_cpus


@pytest.mark.parametrize(("cores", "engines", "mode", "slots"), [
    ([0, 1], 2, "auto", ((0,), (1,))),
    ([0, 1, 2, 3, 4], 2, "auto", ((0, 1, 2), (3, 4))),
    ([4, 5, 6, 7], 4, "auto", ((4,), (5,), (6,), (7,))),
    ([0, 1], 3, "auto", ()),  # fewer cores than engines: float
    ([0, 1, 2, 3], 2, "float", ()),
])
def test_cpu_plan(cores: list[int], engines: int, mode: str,
                  slots: tuple[tuple[int, ...], ...]) -> None:
    plan = plan_cpus(cores, engines, mode)
    assert plan.slots == slots
    assert plan.isolated == bool(slots)
    flat = [c for s in plan.slots for c in s]
    assert len(flat) == len(set(flat))  # disjoint


@pytest.mark.parametrize(("spec", "role", "cpus"), [
    ("all", "prefill", ()),
    ("role", "prefill", (0, 1)),
    ("role", "decode", (2, 3)),
    ("role", "aggregated", ()),
    ("1-2", "decode", (1, 2)),
    ("0,3", "prefill", (0, 3)),
])
def test_worker_cpus(spec: str, role: str, cpus: tuple[int, ...]) -> None:
    assert worker_cpus(spec, role, [0, 1, 2, 3]) == cpus


@pytest.mark.parametrize("spec", ["7", "x", "3-1"])
def test_worker_cpus_rejects_cores_it_cannot_use(spec: str) -> None:
    with pytest.raises(ValueError):
        worker_cpus(spec, "prefill", [0, 1, 2, 3])


@pytest.mark.parametrize(("pinned", "inherited", "online", "said"), [
    ((2, 3), [0, 1, 2, 3], 4, "cores 2,3"),
    ((), [1], 2, "cores 1 (inherited)"),  # `pdserve up` pinned it: not "all cores"
    ((), [0, 1, 2, 3], 4, "all 4 cores"),
])
def test_describe_affinity(pinned: tuple[int, ...], inherited: list[int], online: int,
                           said: str) -> None:
    from serve.cpu_layout import describe_affinity

    assert describe_affinity(pinned, inherited, online) == said
