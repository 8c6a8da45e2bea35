"""The package build compiles the native extension: `pip wheel .` ships `_ucxrma`, and the
wheel installed elsewhere loads it and opens a UCX engine with nothing from the source tree.

The build runs with `--no-build-isolation`: an isolated build would download setuptools and
libucx-cu12 into a throw-away environment (network, a ~30 MB wheel); without isolation it
compiles against the venv's libucx-cu12, the UCX this test then runs against. The source tree
is copied first, so the build writes nothing into the working tree (build/, egg-info, modules
other processes load). One C module: a few seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from kernels.native import build

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("serve", "router", "kvtransfer", "kernels", "bench")
MODULE = f"kernels/native/_ucxrma{sysconfig.get_config_var('EXT_SUFFIX')}"
RECORD = "kernels/native/_ucxrma.build.json"

CHILD = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING)
from kernels import native
from kernels.native import build
module = native.load()
engine = module.Engine(name="wheel-test")
try:
    print(json.dumps({"module": module.__file__, "engine": type(engine).__name__,
                      "address": len(engine.address), "libucp": module.ucp_library(),
                      "stale": build.is_stale()}))
finally:
    engine.close()
"""


def _pip(*args: str, cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PDSERVE_UCX", "PDSERVE_UCX_PREFIX", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, f"pip {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.timeout(300)
def test_wheel_builds_ships_and_loads_the_extension(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.build.json", ".*.lock", "*.tmp")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=ignore)
    assert not list((src / "kernels" / "native").glob("*.so"))  # only the build may make one

    wheels = tmp_path / "wheels"
    _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(src),
         cwd=tmp_path)
    (wheel,) = wheels.glob("pdserve-*.whl")
    assert not wheel.name.endswith("-none-any.whl")  # a platform wheel: it carries a C module
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        record = json.loads(zf.read(RECORD))
    assert MODULE in names
    assert not [n for n in names if n.endswith((".lock", ".tmp"))]
    assert {f"kernels/native/{n}" for n in ("ucx_core.c", "pvm.c", "module.c", "ucxrma.h",
                                            "build.py")} <= names
    assert record["source"] == "wheel"  # the default UCX: the libucx-cu12 wheel
    assert record["site_libdir"] == "libucx/lib"
    assert record[build.DIGEST_KEY] == build.sources_digest()

    target = tmp_path / "target"
    _pip("install", "--no-deps", "--no-compile", "-q", "--target", str(target), str(wheel),
         cwd=tmp_path)
    # -S: no site-packages, so neither the editable install of this tree nor anything else of
    # ours is importable: only the installed wheel (libucp comes through the module's rpath).
    proc = subprocess.run([sys.executable, "-S", "-c", CHILD], cwd=tmp_path,
                          env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(target)},
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert Path(out["module"]) == target / MODULE
    assert out["engine"] == "Engine" and out["address"] > 0
    assert Path(out["libucp"]).name.startswith("libucp.so")
    # pip gives installed files new mtimes in archive order (the module before its sources):
    # the content digest keeps that from reading as a stale build
    assert out["stale"] is False
    assert "older than its sources" not in proc.stderr
