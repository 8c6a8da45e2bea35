"""The EFA-module guard decides from the UCX's module directory, sysfs and the environment."""

from __future__ import annotations

from pathlib import Path

from kernels.native.ucx_modules import SKIP_EFA, efa_devices, efa_module_skipped


def _device(sysfs: Path, name: str, driver: str) -> None:
    drivers = sysfs.parent / "drivers" / driver
    drivers.mkdir(parents=True, exist_ok=True)
    (sysfs / name / "device").mkdir(parents=True)
    (sysfs / name / "device" / "driver").symlink_to(drivers)


def _ucx(tmp_path: Path, *, efa: bool) -> Path:
    modules = tmp_path / ("ucx-efa" if efa else "ucx-plain") / "ucx"
    modules.mkdir(parents=True)
    (modules / "libuct_cma.so.0").touch()
    if efa:
        (modules / "libuct_ib_efa.so.0.0.0").touch()
    return modules


def test_efa_module_is_skipped_while_loading_a_ucx_that_has_it(tmp_path: Path) -> None:
    sysfs = tmp_path / "infiniband"
    _device(sysfs, "mlx5_0", "mlx5_core")  # InfiniBand, but no EFA
    env: dict[str, str] = {}
    with efa_module_skipped(_ucx(tmp_path, efa=True), env, sysfs) as skipped:
        assert skipped and env == {"UCX_MODULES": SKIP_EFA}
    assert env == {}  # children started later do not inherit it


def test_efa_module_stays_with_a_device_a_user_choice_or_no_module(tmp_path: Path) -> None:
    sysfs = tmp_path / "infiniband"
    with_efa = _ucx(tmp_path, efa=True)
    env: dict[str, str] = {}
    with efa_module_skipped(_ucx(tmp_path, efa=False), env, sysfs) as skipped:
        assert not skipped and env == {}  # e.g. the libucx wheel: the variable is unknown there
    with efa_module_skipped(None, env, sysfs) as skipped:
        assert not skipped
    env = {"UCX_MODULES": "all"}
    with efa_module_skipped(with_efa, env, sysfs) as skipped:
        assert not skipped and env == {"UCX_MODULES": "all"}
    assert env == {"UCX_MODULES": "all"}
    _device(sysfs, "rdmap0s6", "efa")
    assert efa_devices(sysfs) == ["rdmap0s6"]
    env = {}
    with efa_module_skipped(with_efa, env, sysfs) as skipped:
        assert not skipped and env == {}
