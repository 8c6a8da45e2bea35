"""The EFA-module guard decides from sysfs and the user's environment only."""

from __future__ import annotations

from pathlib import Path

from kvtransfer.transport.ucx_modules import SKIP_EFA, efa_devices, skip_unusable_efa


def _device(sysfs: Path, name: str, driver: str) -> None:
    drivers = sysfs.parent / "drivers" / driver
    drivers.mkdir(parents=True, exist_ok=True)
    (sysfs / name / "device").mkdir(parents=True)
    (sysfs / name / "device" / "driver").symlink_to(drivers)


def test_efa_module_is_skipped_without_an_efa_device(tmp_path: Path) -> None:
    sysfs = tmp_path / "infiniband"
    env: dict[str, str] = {}
    assert skip_unusable_efa(env, sysfs) is True  # no RDMA devices at all
    assert env == {"UCX_MODULES": SKIP_EFA}
    _device(sysfs, "mlx5_0", "mlx5_core")
    env = {}
    assert skip_unusable_efa(env, sysfs) is True  # InfiniBand but no EFA
    assert env["UCX_MODULES"] == SKIP_EFA


def test_efa_module_stays_with_an_efa_device_or_a_user_choice(tmp_path: Path) -> None:
    sysfs = tmp_path / "infiniband"
    _device(sysfs, "rdmap0s6", "efa")
    assert efa_devices(sysfs) == ["rdmap0s6"]
    env: dict[str, str] = {}
    assert skip_unusable_efa(env, sysfs) is False
    assert env == {}
    env = {"UCX_MODULES": "all"}
    assert skip_unusable_efa(env, tmp_path / "none") is False
    assert env == {"UCX_MODULES": "all"}
