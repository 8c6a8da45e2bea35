"""The native transport built against two UCX installs on this box, and between two "hosts".

Builds `_ucxrma` twice into temporary directories: against the libucx wheel (UCX 1.22 here) and
against the UCX bundled in nixl-cu12 (1.23 here), then pulls between real processes, one on
each build, and checks every byte. The cross-host case runs server and client in their own
network and pid namespaces joined by a veth pair (bench/netns.py), where UCX must use tcp.
`pdserve doctor` reports each build.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.netns import host_pair, unavailable_reason
from kernels.native import build
from tests.support.ucx_peer import NUM_BLOCKS, Proc, expected_sha256, start

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = [int(b) for b in np.random.default_rng(3).permutation(NUM_BLOCKS - 1)[:24]]


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The extension built against each UCX install found here."""
    if importlib.util.find_spec("nixl_cu12") is None:
        pytest.skip("nixl-cu12 is not installed (make setup installs it): only one UCX here")
    out = {}
    for name, install in (("wheel", build.wheel_install()), ("nixl", build.nixl_install())):
        out[name] = build.build(install=install, out_dir=tmp_path_factory.mktemp(name))
    return {name: path.parent for name, path in out.items()}


@contextlib.contextmanager
def _pair(server_build: Path | None, client_build: Path | None, *, locality: bool,
          wraps: tuple[Any, Any] = (None, None),
          env: dict[str, str] | None = None) -> Iterator[tuple[Proc, Proc, Any]]:
    server = client = None
    try:
        server = start(server_build, {"role": "serve"}, wraps[0], env)
        coords = server.ch.recv()
        client = start(client_build, {"role": "pull", "server": coords, "blocks": BLOCKS,
                                       "locality": locality}, wraps[1], env)
        yield server, client, coords
    finally:
        for proc in (client, server):
            if proc is not None:
                proc.stop()


@pytest.mark.parametrize("server_ucx,client_ucx", [("nixl", "wheel"), ("wheel", "nixl")])
def test_pull_between_two_ucx_builds(builds: dict[str, Path], server_ucx: str,
                                     client_ucx: str) -> None:
    with _pair(builds[server_ucx], builds[client_ucx], locality=False) as (_s, client, coords):
        server_info = coords[5]
        first = client.ch.recv()
        client_info = first["info"]
        assert first["path"] == "ucx" and first["sha256"] == expected_sha256(BLOCKS)
        # Negative control: other blocks land other bytes, which the check above would catch.
        shifted = [b + 1 for b in BLOCKS]
        client.ch.send(shifted)
        second = client.ch.recv()
        assert second["sha256"] == expected_sha256(shifted) != expected_sha256(BLOCKS)

    for info, ucx in ((server_info, server_ucx), (client_info, client_ucx)):
        assert info["ucx_source"] == ucx
        assert ("nixl_cu12.libs" in info["libucp"]) == (ucx == "nixl")
    assert server_info["ucx_version"] != client_info["ucx_version"]  # 1.23 vs 1.22 here


def test_pull_across_namespaces_uses_ucx_over_tcp() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"cross-host analog unavailable: {reason}")
    with host_pair() as (a, b), _pair(None, None, locality=True, wraps=(a.wrap, b.wrap),
                                      env={"UCX_TLS": "tcp"}) as (_s, client, coords):
        assert coords[1] != b""  # the server advertised a locality ...
        result = client.ch.recv()
        # ... and the client refused it: another pid namespace, as on another host.
        assert (result["path"], result["path_reason"]) == ("ucx", "different pid namespace")
        assert result["sha256"] == expected_sha256(BLOCKS)
    assert not any(line.startswith((a.netns, b.netns)) for line in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines())


@pytest.mark.parametrize("tls,when,locality", [
    ("default", "before", True), ("tcp", "before", True), ("tcp", "during", True),
    ("tcp", "during", False)])
def test_ucx_get_fails_cleanly_when_the_server_dies(tls: str, when: str, locality: bool) -> None:
    """A dead server fails UCX gets: an error, neither a hang nor a crash. With the server's
    locality (same kernel boot) the data endpoint has no UCX error handling and the control
    endpoint must fail the gets; without it both have peer error handling. With cma (default) a
    GET runs inside the posting call, so only "before" can be staged there; over tcp the server
    serves it, so "during" too. The data endpoint goes without error handling only where cma may
    carry the gets: over tcp UCX leaves a dead peer undefined (a flush once completed OK with the
    bytes never written), so there it keeps peer error handling even toward this boot."""
    from kvtransfer.transport import PeerUnreachable, TransportError, UcxEngine

    env = {"UCX_TLS": "tcp"} if tls == "tcp" else {}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    server = start(None, {"role": "serve"})
    try:
        address, loc, base, length, rkey, _info = server.ch.recv()
        with UcxEngine(name="test-dying-server", same_host=False) as engine:
            dst = np.zeros(length, dtype=np.uint8)
            engine.register(dst.ctypes.data, dst.nbytes, keepalive=dst)
            peer = engine.connect(address, loc if locality else None)
            assert peer.path == "ucx"
            rk = peer.unpack_rkey(rkey, base=base, length=length)
            one = np.array([[dst.ctypes.data, base, length, rk]], dtype=np.uint64)
            peer.get(one).wait(30)  # connected, and the bytes arrive while it lives
            assert dst.any()
            many = np.repeat(one, 1000, axis=0)  # 2 GB
            if when == "before":
                os.kill(server.popen.pid, signal.SIGKILL)
                server.popen.wait(30)
                with pytest.raises((PeerUnreachable, TransportError)):
                    peer.get(many).wait(30)
            else:
                transfer = peer.get(many)
                os.kill(server.popen.pid, signal.SIGKILL)
                with pytest.raises((PeerUnreachable, TransportError)):
                    transfer.wait(30)
                assert transfer.poll() == "error"
            peer.abort()
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.parametrize("ucx", ["wheel", "nixl"])
def test_doctor_reports_each_build(builds: dict[str, Path], ucx: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "serve.doctor", "--json", "--build",
                           str(builds[ucx])], capture_output=True, text=True, cwd=ROOT,
                          check=True)
    report = json.loads(proc.stdout)
    record = build.read_record(builds[ucx])
    assert record is not None and report["built_against"] == ucx
    assert Path(report["libucp"]).parent == Path(str(record["libdir"]))
    assert any(t.startswith("tcp/") for t in report["transports"])
    assert "host" in report["memory_types"]
    verbs = any(m.startswith("uct_ib") for m in report["modules"])
    assert verbs == (ucx == "nixl")  # NIXL's UCX carries verbs modules, the wheel's does not
    assert report["rdma"].startswith("no: this UCX has " + ("verbs" if verbs else "no verbs"))
    assert report["same_host"].startswith("yes")


def test_netns_sweep_deletes_namespaces_of_dead_creators() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    from bench.netns import PREFIX, sweep_stale

    dead = subprocess.Popen(["true"])
    dead.wait()
    live = f"{PREFIX}{os.getpid()}a"
    stale = f"{PREFIX}{dead.pid}b"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert stale in sweep_stale()
        names = subprocess.run(["ip", "netns", "list"], capture_output=True,
                               text=True).stdout.split()
        assert stale not in names and live in names  # our own (live creator) is kept
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
