"""Keep UCX from loading its EFA module on machines without an EFA device.

The nixl-cu12 wheel bundles its own libibverbs and libnl, but its `libuct_ib_efa` links the
system `libefa.so.1`, which pulls in the system libibverbs and libnl beside the bundled copies.
With both libnl-route copies in one process, the bundled one's destructor crashes at exit
(SIGSEGV in `rtnl_tc_unregister`), so every process that created a NIXL agent, or a pdserve
engine built against NIXL's UCX, died with signal 11 after its work was done. The module is of
no use without an EFA device, so it is left out there; a user who set `UCX_MODULES` keeps it.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

INFINIBAND_SYSFS = Path("/sys/class/infiniband")
SKIP_EFA = "^efa"


def efa_devices(sysfs: Path = INFINIBAND_SYSFS) -> list[str]:
    """RDMA devices bound to the `efa` driver (AWS Elastic Fabric Adapter)."""
    if not sysfs.is_dir():
        return []
    return sorted(dev.name for dev in sysfs.iterdir()
                  if (dev / "device" / "driver").resolve().name == "efa")


def skip_unusable_efa(environ: MutableMapping[str, str] | None = None,
                      sysfs: Path = INFINIBAND_SYSFS) -> bool:
    """Set ``UCX_MODULES=^efa`` unless the user set UCX_MODULES or an EFA device exists.

    Must run before the UCX context is created (UCX reads the variable when it loads modules).
    Returns True when it set the variable.
    """
    env = os.environ if environ is None else environ
    if "UCX_MODULES" in env or efa_devices(sysfs):
        return False
    env["UCX_MODULES"] = SKIP_EFA
    return True
