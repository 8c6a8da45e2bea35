"""Two "hosts" on one machine: network + pid namespaces joined by a veth pair.

Processes started through `Host.wrap(argv)` run in their own network namespace (only `lo` and one
end of a veth pair, addresses 10.77.0.1 and 10.77.0.2/30) and their own pid namespace, so between
the two hosts there is no shared-memory, cma or process_vm_readv path: UCX must go over tcp as
between machines, while the traffic stays on this box. Needs root and iproute2 (`ip`); `unshare`
comes from util-linux.

    with host_pair() as (a, b):
        server = subprocess.Popen(a.wrap([sys.executable, "-m", "x"]), ...)
        client = subprocess.Popen(b.wrap([...]), env={..., "SERVER": a.ip})

Cleanup: leaving the context deletes both namespaces (the veth pair goes with them). Namespaces
are named `pdsn<creator pid>a|b`; `sweep_stale()` (called on every `host_pair()`) deletes those
whose creator is gone, so a killed run does not leak them. Kill the processes you started before
leaving the context: a namespace lives on, unnamed, while a process is inside it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

PREFIX = "pdsn"
SUBNET_PREFIX_LEN = 30
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)([ab])$")


class NetnsError(RuntimeError):
    """A namespace or veth could not be created (not root, no iproute2, no kernel support)."""


@dataclass(frozen=True)
class Host:
    """One side of the pair: a network namespace name and its veth address."""

    netns: str
    ip: str

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host's network namespace and a fresh pid namespace.

        `unshare --kill-child`: when the wrapper dies its child is SIGKILLed, and the child is
        pid 1 of the new pid namespace, so everything it started dies with it.
        `--mount-proc`: the namespace's own /proc, so `/proc/<getpid()>` is the caller (vLLM's
        CPU worker reads its own `/proc/{pid}/status`; under the machine's /proc that path is
        another process, or none, and the engine failed to start).
        """
        return [_ip(), "netns", "exec", self.netns, _unshare(), "--pid", "--fork",
                "--mount-proc", "--kill-child", *argv]


def _ip() -> str:
    path = shutil.which("ip") or ("/usr/sbin/ip" if os.path.exists("/usr/sbin/ip") else None)
    if path is None:
        raise NetnsError("iproute2 `ip` not found (apt-get install iproute2)")
    return path


def _unshare() -> str:
    path = shutil.which("unshare")
    if path is None:
        raise NetnsError("`unshare` (util-linux) not found")
    return path


def _run(*args: str) -> None:
    proc = subprocess.run([_ip(), *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")


def _wait_running(host: Host, dev: str, timeout_s: float = 10.0) -> None:
    """Wait until ``dev`` in ``host`` has its carrier (operstate UP). A veth end set up is not
    running at once, and a UCX context created before it is lists only ``lo``: its endpoint
    to the other host then fails with "Destination is unreachable" (seen in 5 of 12 runs of
    the cross-namespace UCX test without this wait)."""
    deadline = time.monotonic() + timeout_s
    while True:
        proc = subprocess.run([_ip(), "-n", host.netns, "-o", "link", "show", "dev", dev],
                              capture_output=True, text=True, check=False)
        if "state UP" in proc.stdout:
            return
        if time.monotonic() > deadline:
            raise NetnsError(f"{dev} in {host.netns} not up after {timeout_s:g} s: "
                             f"{proc.stdout.strip() or proc.stderr.strip()}")
        time.sleep(0.02)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None when they can): for test skips."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        _ip()
        _unshare()
    except NetnsError as exc:
        return str(exc)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete our namespaces whose creating process is gone; returns the names deleted."""
    proc = subprocess.run([_ip(), "netns", "list"], capture_output=True, text=True, check=False)
    gone = []
    for line in proc.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME_RE.match(name)
        if m and not _alive(int(m.group(1))):
            with contextlib.suppress(NetnsError):
                _run("netns", "del", name)
                gone.append(name)
    return gone


def _delete(names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(NetnsError):
            _run("netns", "del", name)


@contextlib.contextmanager
def host_pair() -> Iterator[tuple[Host, Host]]:
    """Create two namespaces joined by a veth pair; delete both on exit (also on errors)."""
    reason = unavailable_reason()
    if reason is not None:
        raise NetnsError(reason)
    sweep_stale()
    pid = os.getpid()
    a, b = Host(f"{PREFIX}{pid}a", "10.77.0.1"), Host(f"{PREFIX}{pid}b", "10.77.0.2")
    veth_a, veth_b = f"vpd{pid}a", f"vpd{pid}b"  # interface names: at most 15 characters
    created: list[str] = []
    try:
        for host in (a, b):
            _run("netns", "add", host.netns)
            created.append(host.netns)
        _run("link", "add", veth_a, "netns", a.netns, "type", "veth", "peer", "name", veth_b,
             "netns", b.netns)
        for host, dev in ((a, veth_a), (b, veth_b)):
            _run("-n", host.netns, "addr", "add", f"{host.ip}/{SUBNET_PREFIX_LEN}", "dev", dev)
            _run("-n", host.netns, "link", "set", dev, "up")
            _run("-n", host.netns, "link", "set", "lo", "up")
        for host, dev in ((a, veth_a), (b, veth_b)):
            _wait_running(host, dev)
        yield a, b
    finally:
        _delete(created)
