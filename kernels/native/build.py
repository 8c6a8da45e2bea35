"""Build the `_ucxrma` C extension against the libucx wheel: `python -m kernels.native.build`.

The module is compiled with gcc into `kernels/native/_ucxrma<EXT_SUFFIX>`, linked to the wheel's
libucp/libucs with an rpath to their directory. The build is skipped when the shared object is
newer than the source; concurrent builders (several spawned processes) serialise on a lock file
and publish the result with an atomic rename.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "ucxrma.c"
MODULE = "_ucxrma"


class NativeBuildError(RuntimeError):
    """gcc failed or the libucx wheel (headers, libraries) is missing."""


def target_path() -> Path:
    """Where the compiled module lives."""
    return HERE / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"


def ucx_prefix() -> Path:
    """Root of the libucx wheel (holds include/ and lib/)."""
    try:
        import libucx
    except ImportError as exc:
        raise NativeBuildError("libucx-cu12 is not installed (pip install libucx-cu12)") from exc
    root = Path(os.path.dirname(libucx.__file__))
    if not (root / "include" / "ucp" / "api" / "ucp.h").is_file():
        raise NativeBuildError(f"no UCX headers under {root / 'include'}")
    return root


def is_stale() -> bool:
    """True when the module is missing or older than its source."""
    out = target_path()
    return not out.exists() or out.stat().st_mtime < SOURCE.stat().st_mtime


def compile_command(out: Path) -> list[str]:
    """The gcc invocation producing `out`."""
    ucx = ucx_prefix()
    lib = ucx / "lib"
    return [
        os.environ.get("CC", "gcc"),
        "-shared",
        "-fPIC",
        "-O2",
        "-g",
        "-Wall",
        "-Werror",
        "-std=gnu11",
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{ucx / 'include'}",
        str(SOURCE),
        "-o",
        str(out),
        f"-L{lib}",
        f"-Wl,-rpath,{lib}",
        "-lucp",
        "-lucs",
        "-lpthread",
    ]


def build(*, force: bool = False) -> Path:
    """Compile the module unless it is up to date; return its path."""
    out = target_path()
    if not force and not is_stale():
        return out
    with open(HERE / f".{MODULE}.build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and not is_stale():  # another process built it while we waited
            return out
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        cmd = compile_command(tmp)
        logger.info("building %s", out.name)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise NativeBuildError(f"gcc failed ({proc.returncode}):\n{proc.stderr}")
        os.replace(tmp, out)
    return out


def ensure_built() -> None:
    """Build the module if it is missing or stale (called lazily on import)."""
    build()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = build(force=args.force)
    except NativeBuildError as exc:
        logger.error("%s", exc)
        return 1
    logger.info("ok: %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
