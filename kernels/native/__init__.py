"""The `_ucxrma` C extension (one-sided UCX transport; sources and build in this directory).

The package build compiles it (setup.py: `pip install .`, `pip wheel .`, editable installs) and
`make setup` rebuilds it when its sources change (`python -m kernels.native.build`), each against
the UCX chosen by PDSERVE_UCX / PDSERVE_UCX_PREFIX; this package only loads it.
`select(build_dir)` makes this process load a build from another directory (tests and
benchmarks that compare UCX installs) and must come before the first `load()`.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

from kernels.native.ucx_modules import efa_module_skipped

logger = logging.getLogger(__name__)

MODULE_NAME = "kernels.native._ucxrma"

_lock = threading.Lock()
_module: ModuleType | None = None
_build_dir: Path | None = None


class NativeUnavailable(ImportError):
    """The extension is not built (or cannot be loaded) here."""


def select(build_dir: Path | str | None) -> None:
    """Load the extension from `build_dir` (None: the package directory) in this process."""
    global _build_dir
    with _lock:
        wanted = None if build_dir is None else Path(build_dir)
        if _module is not None and wanted != _build_dir:
            where = _build_dir or "the package"
            raise RuntimeError(f"{MODULE_NAME} is already loaded from {where}")
        _build_dir = wanted


def load() -> ModuleType:
    """The extension module, imported once per process (never compiled here)."""
    from kernels.native import build

    global _module
    with _lock:
        if _module is not None:
            return _module
        path = build.target_path(_build_dir)
        if not path.exists():
            raise NativeUnavailable(f"{path} is not built: run `make setup` "
                                    "(python -m kernels.native.build)")
        if _build_dir is None and build.is_stale():
            logger.warning("%s is older than its sources: run `make setup` to rebuild", path.name)
        spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
        if spec is None or spec.loader is None:
            raise NativeUnavailable(f"cannot load {path}")
        libdir = (build.read_record(_build_dir) or {}).get("libdir")
        try:
            # libucs reads UCX_MODULES when it loads: module_from_spec dlopens the extension.
            with efa_module_skipped(Path(str(libdir)) / "ucx" if libdir else None):
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
        except ImportError as exc:
            raise NativeUnavailable(f"cannot load {path}: {exc}") from exc
        sys.modules[MODULE_NAME] = module
        _module = module
        return module


def runtime_info() -> dict[str, Any]:
    """Which UCX this process runs: version and path of the loaded libucp, and the build record."""
    from kernels.native import build

    mod = load()
    return {
        "ucx_version": mod.ucp_version(),
        "libucp": mod.ucp_library(),
        **mod.build_info(),
        "module": str(build.target_path(_build_dir)),
        "build": build.read_record(_build_dir),
    }
