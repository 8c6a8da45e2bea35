"""kernels/native/build.py without gcc: when a build counts as stale, and where the module
looks for libucp (rpaths)."""

from __future__ import annotations

import json
import os
import sysconfig
from dataclasses import asdict
from pathlib import Path

import pytest

from kernels.native import build

WHEEL = build.UcxInstall("wheel", "/site/libucx/include", "/site/libucx/lib", ("-lucp", "-lucs"),
                         "1.22", site_libdir="libucx/lib")
SITE = sysconfig.get_paths()["platlib"]
PREFIX = build.UcxInstall("prefix", "/usr/include", "/usr/lib/x86_64-linux-gnu",
                          ("-lucp", "-lucs"), "1.20")


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Fake sources and header in tmp_path/src; builds go to tmp_path/out."""
    src = tmp_path / "src"
    src.mkdir()
    sources = tuple(src / n for n in ("ucx_core.c", "pvm.c", "module.c"))
    for path in sources:
        path.write_text(f"/* {path.name} */\n")
    (src / "ucxrma.h").write_text("/* header */\n")
    monkeypatch.setattr(build, "SOURCES", sources)
    monkeypatch.setattr(build, "HEADERS", (src / "ucxrma.h",))
    (tmp_path / "out").mkdir()
    return tmp_path


def _fake_build(out_dir: Path, install: build.UcxInstall, *, digest: bool = True) -> None:
    """What build() leaves behind: the module and its record (with or without the digest)."""
    build.target_path(out_dir).write_bytes(b"\x7fELF")
    record = asdict(install) | ({build.DIGEST_KEY: build.sources_digest()} if digest else {})
    build.record_path(out_dir).write_text(json.dumps(record))


def _age(path: Path, seconds: float) -> None:
    st = path.stat()
    os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds))


def test_same_sources_by_content_are_not_stale_whatever_the_mtimes(tree: Path) -> None:
    out = tree / "out"
    _fake_build(out, WHEEL)
    _age(build.target_path(out), 3600)  # a wheel install: the module older than its sources
    assert build.is_stale(out_dir=out) is False
    assert build.is_stale(WHEEL, out) is False


def test_changed_source_is_stale(tree: Path) -> None:
    out = tree / "out"
    _fake_build(out, WHEEL)
    build.SOURCES[1].write_text("/* pvm.c, edited */\n")
    assert build.is_stale(out_dir=out) is True


def test_other_ucx_or_missing_module_is_stale(tree: Path) -> None:
    out = tree / "out"
    assert build.is_stale(out_dir=out) is True  # nothing built yet
    _fake_build(out, WHEEL)
    assert build.is_stale(PREFIX, out) is True


def test_record_without_digest_falls_back_to_mtimes(tree: Path) -> None:
    out = tree / "out"
    _fake_build(out, WHEEL, digest=False)
    assert build.is_stale(WHEEL, out) is False
    _age(build.target_path(out), 3600)
    assert build.is_stale(WHEEL, out) is True


def test_missing_sources_do_not_make_an_installed_module_stale(tree: Path) -> None:
    out = tree / "out"
    _fake_build(out, WHEEL)
    build.SOURCES[0].unlink()  # nothing to rebuild from: keep the module
    assert build.sources_digest() is None
    assert build.is_stale(out_dir=out) is False


@pytest.mark.parametrize(("install", "expected"), [
    # a wheel's UCX: first beside the installed package (kernels/native is two levels below
    # site-packages), then in this interpreter's site-packages, then where it was built
    (WHEEL, ["$ORIGIN/../../libucx/lib", f"{SITE}/libucx/lib", "/site/libucx/lib"]),
    (PREFIX, ["/usr/lib/x86_64-linux-gnu"]),
])
def test_rpaths(install: build.UcxInstall, expected: list[str]) -> None:
    assert build.rpaths(install) == expected
    cmd = build.compile_command(install, Path("/tmp/x.so"))
    assert [a.removeprefix("-Wl,-rpath,") for a in cmd if a.startswith("-Wl,-rpath,")] == expected


def test_extra_cflags_reach_gcc_and_the_record(tree: Path) -> None:
    """An instrumented copy (the ASAN test's) is its own build: asking for other flags, or for
    none, rebuilds; the package's own loader does not compare flags."""
    out = tree / "out"
    _fake_build(out, WHEEL)  # a plain build: its record names no flags
    assert build.is_stale(WHEEL, out, ()) is False
    assert build.is_stale(WHEEL, out, ("-fsanitize=address",)) is True
    record = json.loads(build.record_path(out).read_text())
    record[build.CFLAGS_KEY] = ["-fsanitize=address"]
    build.record_path(out).write_text(json.dumps(record))
    assert build.is_stale(WHEEL, out, ("-fsanitize=address",)) is False
    assert build.is_stale(WHEEL, out, ()) is True
    assert build.is_stale(WHEEL, out) is False
    cmd = build.compile_command(WHEEL, Path("/tmp/x.so"), ("-fsanitize=address", "-O1"))
    assert cmd[cmd.index("-std=gnu11") + 1:][:2] == ["-fsanitize=address", "-O1"]
