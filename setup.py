"""The package build compiles the native extension: ``pip install .`` / ``pip wheel .`` / ``-e``.

Metadata lives in pyproject.toml; this file only adds ``kernels.native._ucxrma`` as an extension
whose ``build_ext`` hands the work to ``kernels/native/build.py`` (the same gcc command, UCX
choice, rpaths and build record as ``python -m kernels.native.build``): the UCX is chosen by
``PDSERVE_UCX`` / ``PDSERVE_UCX_PREFIX``, default the libucx-cu12 wheel of the build environment.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

ROOT = Path(__file__).resolve().parent
NATIVE = Path("kernels") / "native"


def native_build() -> ModuleType:
    """kernels/native/build.py, loaded by path (stdlib only: no need to import our packages)."""
    name = "_pdserve_native_build"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / NATIVE / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


class BuildNative(build_ext):
    """``build_ext`` through kernels/native/build.py.

    In place (``build_ext --inplace``, editable installs) the module is built straight into the
    package directory, where build.py publishes it with an atomic rename and skips an
    up-to-date build: setuptools' copy would overwrite a module other processes may have
    mapped, and without its build record."""

    def run(self) -> None:
        self._in_place = bool(self.inplace)  # super().run() clears it while building
        super().run()

    def build_extension(self, ext: Extension) -> None:
        native = native_build()
        regular = Path(self.get_ext_fullpath(ext.name))
        try:
            if self._in_place:
                inplace, _ = self._get_inplace_equivalent(
                    self.get_finalized_command("build_py"), ext)
                built = native.build(force=self.force, out_dir=Path(inplace).parent.resolve())
                regular.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(built, regular)
            else:
                built = native.build(force=self.force, out_dir=regular.parent.resolve())
                # the build tree is this build's own: its lock file need not ship in the wheel
                (built.parent / f".{native.MODULE}.build.lock").unlink(missing_ok=True)
        except native.NativeBuildError as exc:
            raise CompileError(f"building {ext.name}: {exc}") from exc

    def copy_extensions_to_source(self) -> None:
        """Nothing to copy: :meth:`build_extension` built in place."""


setup(
    ext_modules=[Extension("kernels.native._ucxrma",
                           sources=[str(NATIVE / n) for n in ("ucx_core.c", "pvm.c", "module.c")],
                           depends=[str(NATIVE / "ucxrma.h")])],
    cmdclass={"build_ext": BuildNative},
)
