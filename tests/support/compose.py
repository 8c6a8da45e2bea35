"""A Docker engine, docker-compose and the deploy/ images, made available from nothing.

On a fresh CI machine (Debian bookworm, root, no registry reachable) this installs Debian's
``docker.io``, ``containerd``, ``debootstrap`` and ``docker-compose`` (1.29), starts containerd
and dockerd in the background (no systemd), builds a Debian base image with debootstrap and
imports it, then builds the pdserve and Prometheus images on it. Every step is skipped when its
result already exists, so a second run costs seconds (the pdserve image build runs every time but
is a BuildKit cache hit unless the code changed). The engine is left running on purpose: it is
the cache the next run reuses.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BASE_IMAGE = "localhost/debian:bookworm"
PDSERVE_IMAGE = "localhost/pdserve:cpu"
PROMETHEUS_IMAGE = "localhost/prometheus:bookworm"
DOCKER_SOCK = "/var/run/docker.sock"
CONTAINERD_SOCK = "/run/containerd/containerd.sock"
LOG_DIR = Path("/var/log/pdserve-test")


class ComposeSetupError(RuntimeError):
    """A tool could not be installed, the engine did not start, or an image did not build."""


def run(cmd: list[str], *, timeout_s: float, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; on failure raise with its output (the tail is what explains a failure)."""
    logger.info("$ %s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, timeout=timeout_s, env=env, text=True,
                          stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise ComposeSetupError(f"{' '.join(cmd)} exited {proc.returncode}:\n"
                                f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def docker_cli() -> str:
    """The docker client to use: Debian's 20.10 CLI builds with BuildKit built in (a newer
    CLI without the buildx plugin cannot), so prefer it over any other on PATH."""
    if os.access("/usr/bin/docker", os.X_OK):
        return "/usr/bin/docker"
    found = shutil.which("docker")
    if not found:
        raise ComposeSetupError("no docker client")
    return found


def _apt_install(packages: list[str], *, no_recommends: bool = False) -> None:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run(["apt-get", "update", "-qq"], timeout_s=300, env=env)
    cmd = ["apt-get", "install", "-y", "-qq"]
    if no_recommends:
        cmd.append("--no-install-recommends")
    run(cmd + packages, timeout_s=900, env=env)


def ensure_tools() -> None:
    """Install the engine, docker-compose and debootstrap from Debian when missing."""
    missing = [pkg for exe, pkg in (("dockerd", "docker.io"), ("containerd", "containerd"),
                                    ("debootstrap", "debootstrap"))
               if not shutil.which(exe) and not os.path.exists(f"/usr/sbin/{exe}")]
    if missing:
        _apt_install(missing)
    if not shutil.which("docker-compose"):
        # Without recommends: they would pull a second engine flavour and its config.
        _apt_install(["docker-compose"], no_recommends=True)


def _engine_up() -> bool:
    return subprocess.run([docker_cli(), "info"], capture_output=True,
                          timeout=30).returncode == 0


def _spawn_daemon(cmd: list[str], log_name: str) -> None:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    with open(LOG_DIR / log_name, "ab") as log:
        subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True)


def _wait(probe_ok: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe_ok():
        if time.monotonic() > deadline:
            raise ComposeSetupError(f"{what} not up within {timeout_s} s (logs in {LOG_DIR})")
        time.sleep(0.5)


def _socket_answers(path: str) -> bool:
    """True when something accepts connections on the unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        try:
            sock.connect(path)
        except OSError:
            return False
    return True


def ensure_engine() -> None:
    """Start containerd and dockerd in the background unless the engine already answers."""
    if _engine_up():
        return
    containerd = shutil.which("containerd") or "/usr/bin/containerd"
    dockerd = shutil.which("dockerd") or "/usr/sbin/dockerd"
    if not _socket_answers(CONTAINERD_SOCK):
        # A socket file left by a containerd that died would make dockerd wait on nothing.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(CONTAINERD_SOCK)
        _spawn_daemon([containerd], "containerd.log")
        _wait(lambda: _socket_answers(CONTAINERD_SOCK), "containerd", 60)
    _spawn_daemon([dockerd, f"--containerd={CONTAINERD_SOCK}"], "dockerd.log")
    _wait(_engine_up, "dockerd", 120)


def image_exists(name: str) -> bool:
    return subprocess.run([docker_cli(), "image", "inspect", name], capture_output=True,
                          timeout=60).returncode == 0


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 or one-line sources)."""
    files = ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*"))]
    for path in files:
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        for url in re.findall(r"^(?:URIs:\s*|deb\s+(?:\[[^\]]*\]\s+)?)(\S+)", text, re.M):
            if re.search(r"/debian/?$", url):
                return url
    return "http://deb.debian.org/debian"


def ensure_base_image() -> None:
    """``localhost/debian:bookworm`` from debootstrap (no registry needed)."""
    if image_exists(BASE_IMAGE):
        return
    with tempfile.TemporaryDirectory(prefix="pdserve-rootfs-") as rootfs:
        run(["debootstrap", "--variant=minbase", "bookworm", rootfs, debian_mirror()],
            timeout_s=900)
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        imp = subprocess.run([docker_cli(), "import", "-", BASE_IMAGE], stdin=tar.stdout,
                             capture_output=True, text=True, timeout=600)
        tar.wait()
        if imp.returncode != 0 or tar.returncode != 0:
            raise ComposeSetupError(f"docker import failed: {imp.stderr}")


def _local_torch_wheels() -> list[str]:
    """CPU torch wheels pip on this machine finds through its ``find-links``."""
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                          text=True, timeout=60)
    dirs = re.findall(r"find-links='([^']+)'", proc.stdout)
    wheels: set[str] = set()
    for entry in dirs:
        for d in entry.split():
            wheels.update(glob.glob(os.path.join(d.removeprefix("file://"), "torch-*+cpu-*.whl")))
    return sorted(wheels)


def stage_build_inputs() -> dict[str, str]:
    """Copy this machine's CA certificates and CPU torch wheel into deploy/ (git-ignored dirs);
    return the build args that match (torch offline from the wheel when one is staged)."""
    certs = DEPLOY / "ca-certs"
    for crt in glob.glob("/usr/local/share/ca-certificates/**/*.crt", recursive=True):
        dest = certs / os.path.basename(crt)
        if not dest.exists() or dest.read_bytes() != Path(crt).read_bytes():
            shutil.copyfile(crt, dest)
    wheels = DEPLOY / "wheels"
    for whl in _local_torch_wheels():
        dest = wheels / os.path.basename(whl)
        if not dest.exists() or dest.stat().st_size != os.path.getsize(whl):
            shutil.copyfile(whl, dest)
    args = {"BASE_IMAGE": BASE_IMAGE}
    if glob.glob(str(wheels / "torch-*+cpu-*.whl")):
        args["TORCH_INDEX_URL"] = ""
    return args


def build_image(dockerfile: Path, tag: str, context: Path, args: dict[str, str],
                timeout_s: float) -> None:
    cmd = [docker_cli(), "build", "-q", "-f", str(dockerfile), "-t", tag]
    for key, val in args.items():
        cmd += ["--build-arg", f"{key}={val}"]
    run(cmd + [str(context)], timeout_s=timeout_s, env=dict(os.environ, DOCKER_BUILDKIT="1"))


@dataclass(frozen=True)
class Images:
    pdserve: str
    redis: str
    prometheus: str
    timings_s: dict[str, float]


def ensure_images() -> Images:
    """Base image, pdserve image (BuildKit cache hit when unchanged), Prometheus image."""
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    ensure_base_image()
    timings["base_image"] = time.monotonic() - t0
    args = stage_build_inputs()
    t0 = time.monotonic()
    build_image(DEPLOY / "Dockerfile", PDSERVE_IMAGE, ROOT, args, timeout_s=3600)
    timings["pdserve_image"] = time.monotonic() - t0
    t0 = time.monotonic()
    if not image_exists(PROMETHEUS_IMAGE):
        build_image(DEPLOY / "Dockerfile.prometheus", PROMETHEUS_IMAGE, DEPLOY,
                    {"BASE_IMAGE": BASE_IMAGE}, timeout_s=900)
    timings["prometheus_image"] = time.monotonic() - t0
    # The pdserve image ships Debian's redis-server: no Redis image to pull.
    return Images(PDSERVE_IMAGE, PDSERVE_IMAGE, PROMETHEUS_IMAGE, timings)


def compose_cmd() -> list[str]:
    """docker-compose 1.29 when installed (what CI has), else the Compose v2 plugin."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return [docker_cli(), "compose"]


def project_resources(project: str) -> dict[str, list[str]]:
    """Containers (any state), networks and volumes labelled with the compose project."""
    label = f"label=com.docker.compose.project={project}"
    out: dict[str, list[str]] = {}
    for kind, cmd in (("containers", ["ps", "-a", "-q"]), ("networks", ["network", "ls", "-q"]),
                      ("volumes", ["volume", "ls", "-q"])):
        proc = run([docker_cli(), *cmd, "--filter", label], timeout_s=60)
        out[kind] = proc.stdout.split()
    return out


def container_health(container_id: str) -> str:
    proc = run([docker_cli(), "inspect", container_id], timeout_s=60)
    state = json.loads(proc.stdout)[0]["State"]
    return str(state.get("Health", {}).get("Status") or state.get("Status"))
