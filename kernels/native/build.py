"""Build the `_ucxrma` C extension against a chosen UCX: `python -m kernels.native.build`.

    python -m kernels.native.build                      # the libucx wheel (default)
    python -m kernels.native.build --ucx nixl           # the UCX bundled in the nixl-cu12 wheel
    python -m kernels.native.build --ucx-prefix /usr    # a system UCX (include/ and lib/)
    PDSERVE_UCX=nixl make setup                         # the same choice through `make setup`
    python -m kernels.native.build --out /tmp/asan --cflags "-fsanitize=address"
                                                        # an instrumented copy elsewhere

Which UCX: `--ucx wheel|nixl|prefix` (env `PDSERVE_UCX`), `--ucx-prefix DIR` (env
`PDSERVE_UCX_PREFIX`, implies `prefix`); default `wheel`.
  wheel   libucx-cu12's headers and libucp/libucs (tcp, cma, cuda; no verbs).
  nixl    the libucp/libucs that nixl-cu12 bundles under `nixl_cu12.libs/` (its UCX modules,
          verbs/mlx5/efa included, sit in `nixl_cu12.libs/ucx/`). That wheel ships no UCX headers,
          so the module is compiled with the libucx wheel's headers and linked to NIXL's
          libraries: this relies on UCX's backward ABI compatibility within 1.x (parameter structs
          carry field masks; the headers' API version must not be newer than the library, which
          the build checks).
  prefix  a system UCX: `<prefix>/include/ucp/api/ucp.h` and libucp in `<prefix>/lib`,
          `lib64` or `lib/<multiarch>`.
The module is compiled with gcc from ucx_core.c, pvm.c and module.c into
`kernels/native/_ucxrma<EXT_SUFFIX>` (or `--out DIR`), with rpaths to the chosen libraries (for
the wheels: first the copy installed beside the package, then the one it was built with); a
JSON record beside it (`_ucxrma.build.json`) says what it was built against and from which
sources (their sha256) with which extra compiler flags (`--cflags`, e.g. AddressSanitizer for
a test's copy; a process loads such a copy with `kernels.native.select` and needs libasan
preloaded). The build is skipped when the module was built from the same sources
against the same choice; concurrent builders serialise on a lock file and publish with an atomic
rename. Nothing builds at import time: the package build (setup.py: `pip install .`,
`pip wheel .`, editable installs) and `make setup` run this; both the module and its record are
build outputs, never committed.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import hashlib
import importlib.util
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
SOURCES = tuple(HERE / name for name in ("ucx_core.c", "pvm.c", "module.c"))
HEADERS = (HERE / "ucxrma.h",)
MODULE = "_ucxrma"
DIGEST_KEY = "sources_sha256"
"""Key of the build record holding :func:`sources_digest` of the sources it was built from."""
CFLAGS_KEY = "extra_cflags"
"""Key of the build record holding the extra compiler flags of the build (absent: none)."""
CHOICES = ("wheel", "nixl", "prefix")


class NativeBuildError(RuntimeError):
    """gcc failed or the chosen UCX (headers, libraries) is missing."""


@dataclass(frozen=True)
class UcxInstall:
    """Where one UCX's headers and libraries are, as the build uses them."""

    source: str
    """"wheel", "nixl" or "prefix"."""
    include: str
    """Directory holding ucp/api/ucp.h."""
    libdir: str
    """Directory holding libucp and libucs (also the rpath)."""
    libs: tuple[str, ...]
    """Linker arguments naming libucp and libucs."""
    header_api: str
    """UCP_API_MAJOR.UCP_API_MINOR of the headers."""
    note: str = ""
    """How headers and libraries relate when they come from different packages."""
    site_libdir: str = ""
    """``libdir`` relative to the site-packages holding it (wheels; "" for a system UCX): the
    module's first rpaths (see :func:`rpaths`) look for it beside the installed module and in
    this interpreter's site-packages, so a module compiled in pip's isolated build environment
    still finds its UCX after that environment is gone."""


def target_path(out_dir: Path | None = None) -> Path:
    """Where the compiled module lives."""
    return (out_dir or HERE) / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"


def record_path(out_dir: Path | None = None) -> Path:
    """The JSON record of what the module in `out_dir` was built against."""
    return (out_dir or HERE) / f"{MODULE}.build.json"


def _header_api(include: Path) -> str:
    text = (include / "ucp" / "api" / "ucp_version.h").read_text()
    major = re.search(r"#define\s+UCP_API_MAJOR\s+(\d+)", text)
    minor = re.search(r"#define\s+UCP_API_MINOR\s+(\d+)", text)
    if not major or not minor:
        raise NativeBuildError(f"no UCP_API_MAJOR/MINOR in {include}/ucp/api/ucp_version.h")
    return f"{major.group(1)}.{minor.group(1)}"


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise NativeBuildError(f"python package {name} is not installed")
    return Path(spec.origin).parent


def wheel_install() -> UcxInstall:
    """libucx-cu12: headers and libraries from one wheel."""
    try:
        root = _package_dir("libucx")
    except NativeBuildError as exc:
        raise NativeBuildError("libucx-cu12 is not installed (pip install libucx-cu12)") from exc
    include = root / "include"
    if not (include / "ucp" / "api" / "ucp.h").is_file():
        raise NativeBuildError(f"no UCX headers under {include}")
    return UcxInstall("wheel", str(include), str(root / "lib"), ("-lucp", "-lucs"),
                      _header_api(include), site_libdir=f"{root.name}/lib")


def _library_version(path: str) -> str:
    """ucp_get_version_string() of a libucp, read by loading it in a child process."""
    code = ("import ctypes,sys; f=ctypes.CDLL(sys.argv[1]).ucp_get_version_string; "
            "f.restype=ctypes.c_char_p; print(f().decode())")
    proc = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise NativeBuildError(f"cannot load {path}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def nixl_install() -> UcxInstall:
    """nixl-cu12's bundled UCX, compiled with the libucx wheel's (older or equal) headers."""
    libdir = _package_dir("nixl_cu12").parent / "nixl_cu12.libs"
    found = {}
    for lib in ("ucp", "ucs"):
        hits = sorted(glob.glob(str(libdir / f"lib{lib}-*.so*")))
        if not hits:
            raise NativeBuildError(f"no lib{lib} in {libdir} (is nixl-cu12 installed?)")
        found[lib] = hits[0]
    headers = wheel_install()
    version = _library_version(found["ucp"])
    lib_api = tuple(int(x) for x in version.split(".")[:2])
    hdr_api = tuple(int(x) for x in headers.header_api.split("."))
    if hdr_api[0] != lib_api[0] or hdr_api > lib_api:
        raise NativeBuildError(f"headers UCP API {headers.header_api} are newer than NIXL's "
                               f"libucp {version}: not ABI-compatible")
    note = (f"nixl-cu12 ships no UCX headers: compiled with libucx's UCP API "
            f"{headers.header_api} headers, linked to NIXL's libucp {version} (backward "
            f"compatible within UCX 1.x)")
    return UcxInstall("nixl", headers.include, str(libdir),
                      tuple(f"-l:{Path(p).name}" for p in found.values()), headers.header_api,
                      note, site_libdir=libdir.name)


def prefix_install(prefix: str) -> UcxInstall:
    """A system UCX under `prefix`."""
    root = Path(prefix)
    include = root / "include"
    if not (include / "ucp" / "api" / "ucp.h").is_file():
        raise NativeBuildError(f"no ucp/api/ucp.h under {include}")
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    for cand in (root / "lib", root / "lib64", root / "lib" / multiarch):
        if glob.glob(str(cand / "libucp.so*")):
            return UcxInstall("prefix", str(include), str(cand), ("-lucp", "-lucs"),
                              _header_api(include))
    raise NativeBuildError(f"no libucp.so under {root}/lib, lib64 or lib/{multiarch}")


def resolve(ucx: str | None = None, prefix: str | None = None) -> UcxInstall:
    """The UCX install chosen by arguments, else PDSERVE_UCX / PDSERVE_UCX_PREFIX, else wheel."""
    prefix = prefix or os.environ.get("PDSERVE_UCX_PREFIX") or None
    ucx = ucx or os.environ.get("PDSERVE_UCX") or ("prefix" if prefix else "wheel")
    if ucx not in CHOICES:
        raise NativeBuildError(f"unknown UCX choice {ucx!r}; allowed: {list(CHOICES)}")
    if ucx == "wheel":
        return wheel_install()
    if ucx == "nixl":
        return nixl_install()
    if not prefix:
        raise NativeBuildError("--ucx prefix needs --ucx-prefix DIR (or PDSERVE_UCX_PREFIX)")
    return prefix_install(prefix)


def read_record(out_dir: Path | None = None) -> dict[str, object] | None:
    """What the module in `out_dir` was built against (None when unknown)."""
    try:
        data: dict[str, object] = json.loads(record_path(out_dir).read_text())
    except (OSError, ValueError):
        return None
    return data


def sources_digest() -> str | None:
    """sha256 over the names and bytes of the sources and headers (None: some are missing)."""
    digest = hashlib.sha256()
    try:
        for path in (*SOURCES, *HEADERS):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    except FileNotFoundError:
        return None
    return digest.hexdigest()


def is_stale(install: UcxInstall | None = None, out_dir: Path | None = None,
             extra_cflags: tuple[str, ...] | None = None) -> bool:
    """True when the module is missing, built from other sources, against another UCX, or (when
    `extra_cflags` is given) with other extra compiler flags.

    Sources are compared by content when the build record has their digest: installing a
    wheel gives its files fresh, arbitrary mtimes. Records without it compare mtimes."""
    out = target_path(out_dir)
    if not out.exists():
        return True
    record = read_record(out_dir) or {}
    built_from = record.pop(DIGEST_KEY, None)
    built_flags = record.pop(CFLAGS_KEY, None) or []
    if extra_cflags is not None and list(extra_cflags) != built_flags:
        return True
    if built_from is not None:
        current = sources_digest()
        if current is not None and current != built_from:
            return True
    elif out.stat().st_mtime < max(p.stat().st_mtime for p in (*SOURCES, *HEADERS)):
        return True
    return install is not None and record != json.loads(json.dumps(asdict(install)))


def rpaths(install: UcxInstall) -> list[str]:
    """Where the module looks for libucp/libucs, first match wins: a wheel's UCX beside the
    module in the same site-packages (kernels/native/ is two levels below it), then in this
    interpreter's site-packages (an editable install: the module stays in the source tree), then
    where it was built (gone after pip's isolated build; right for `--out` and other UCX)."""
    paths = []
    if install.site_libdir:
        paths += [f"$ORIGIN/../../{install.site_libdir}",
                  str(Path(sysconfig.get_paths()["platlib"]) / install.site_libdir)]
    return list(dict.fromkeys([*paths, install.libdir]))


def compile_command(install: UcxInstall, out: Path,
                    extra_cflags: tuple[str, ...] = ()) -> list[str]:
    """The gcc invocation producing `out` (`extra_cflags` go after the defaults)."""
    return [
        os.environ.get("CC", "gcc"), "-shared", "-fPIC", "-O2", "-g", "-Wall", "-Werror",
        "-std=gnu11", *extra_cflags, f"-DPDSERVE_UCX_SOURCE=\"{install.source}\"",
        f"-I{sysconfig.get_paths()['include']}", f"-I{install.include}",
        *(str(s) for s in SOURCES), "-o", str(out),
        f"-L{install.libdir}", *(f"-Wl,-rpath,{path}" for path in rpaths(install)),
        *install.libs, "-ldl", "-lpthread",
    ]


def build(*, force: bool = False, install: UcxInstall | None = None,
          out_dir: Path | None = None, extra_cflags: tuple[str, ...] = ()) -> Path:
    """Compile the module unless it is up to date for `install` and `extra_cflags`; return its
    path. `extra_cflags` (e.g. ``("-fsanitize=address",)``) are passed to gcc after the defaults,
    at compile and link time."""
    install = install or resolve()
    out = target_path(out_dir)
    if not force and not is_stale(install, out_dir, extra_cflags):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{MODULE}.build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and not is_stale(install, out_dir, extra_cflags):  # built while we waited
            return out
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        logger.info("building %s against UCX %s (%s)", out, install.source, install.libdir)
        if install.note:
            logger.info("%s", install.note)
        proc = subprocess.run(compile_command(install, tmp, extra_cflags), capture_output=True,
                              text=True, check=False)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise NativeBuildError(f"gcc failed ({proc.returncode}):\n{proc.stderr}")
        record = record_path(out_dir)
        tmp_record = record.with_name(f".{record.name}.{os.getpid()}.tmp")
        record_data = {**asdict(install), DIGEST_KEY: sources_digest(),
                       **({CFLAGS_KEY: list(extra_cflags)} if extra_cflags else {})}
        tmp_record.write_text(json.dumps(record_data, indent=2) + "\n")
        os.replace(tmp, out)
        os.replace(tmp_record, record)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ucx", choices=CHOICES, help="which UCX (default: $PDSERVE_UCX, wheel)")
    parser.add_argument("--ucx-prefix", help="a system UCX's prefix (default: $PDSERVE_UCX_PREFIX)")
    parser.add_argument("--out", type=Path, help="directory of the module (default: the package)")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--cflags", default="",
                        help="extra gcc flags, one shell-quoted string (e.g. -fsanitize=address)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = build(force=args.force, install=resolve(args.ucx, args.ucx_prefix),
                     out_dir=args.out, extra_cflags=tuple(shlex.split(args.cflags)))
    except NativeBuildError as exc:
        logger.error("%s", exc)
        return 1
    logger.info("ok: %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
