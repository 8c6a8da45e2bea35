"""Keep UCX from loading its EFA module on machines without an EFA device.

The nixl-cu12 wheel bundles its own libibverbs and libnl, but its `libuct_ib_efa` links the
system `libefa.so.1`, which pulls in the system libibverbs and libnl beside the bundled copies.
With both libnl-route copies in one process, the bundled one's destructor crashes at exit
(SIGSEGV in `rtnl_tc_unregister`), so every process that created a NIXL agent, or loaded a
pdserve extension built against NIXL's UCX, died with signal 11 after its work was done.

The module is of no use without an EFA device, so `efa_module_skipped` sets
``UCX_MODULES=^efa`` while a UCX whose module directory holds it is loaded and initialised, and
restores the environment after, so child processes (which may run another UCX, where the
variable is unknown and UCX prints a warning on stdout) do not inherit it. A user who set
``UCX_MODULES`` keeps their choice.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, MutableMapping
from pathlib import Path

INFINIBAND_SYSFS = Path("/sys/class/infiniband")
SKIP_EFA = "^efa"
EFA_MODULE_GLOB = "libuct_ib_efa.so*"


def efa_devices(sysfs: Path = INFINIBAND_SYSFS) -> list[str]:
    """RDMA devices bound to the `efa` driver (AWS Elastic Fabric Adapter)."""
    if not sysfs.is_dir():
        return []
    return sorted(dev.name for dev in sysfs.iterdir()
                  if (dev / "device" / "driver").resolve().name == "efa")


def should_skip_efa(module_dir: Path | None, environ: MutableMapping[str, str],
                    sysfs: Path = INFINIBAND_SYSFS) -> bool:
    """True when ``module_dir`` (a UCX's `ucx/` module directory) holds the EFA module, the
    machine has no EFA device and the user did not choose modules (``UCX_MODULES``)."""
    if module_dir is None or "UCX_MODULES" in environ:
        return False
    if not any(module_dir.glob(EFA_MODULE_GLOB)):
        return False
    return not efa_devices(sysfs)


@contextlib.contextmanager
def efa_module_skipped(module_dir: Path | None, environ: MutableMapping[str, str] | None = None,
                       sysfs: Path = INFINIBAND_SYSFS) -> Iterator[bool]:
    """Within the block, ``UCX_MODULES=^efa`` when :func:`should_skip_efa`; yields whether set.

    Load the UCX libraries (its modules are read when libucs loads) and create the first UCX
    context inside the block.
    """
    env = os.environ if environ is None else environ
    skip = should_skip_efa(module_dir, env, sysfs)
    if skip:
        env["UCX_MODULES"] = SKIP_EFA
    try:
        yield skip
    finally:
        if skip and env.get("UCX_MODULES") == SKIP_EFA:
            del env["UCX_MODULES"]


def nixl_module_dir() -> Path | None:
    """The UCX module directory the nixl-cu12 wheel bundles (None when not installed)."""
    import importlib.util

    spec = importlib.util.find_spec("nixl_cu12")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent / "nixl_cu12.libs" / "ucx"
