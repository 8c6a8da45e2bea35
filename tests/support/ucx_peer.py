"""One UCX engine in its own process, driven over stdin/stdout (for tests that need another
"host", another UCX build, or a process to kill).

    python -m tests.support.ucx_peer BUILD_DIR|-

Messages are `bench.kv_transfer_peer.Channel` lines. The first one names the role:
  {"role": "serve"}  register `pattern(NUM_BLOCKS * BLOCK, SEED)`, answer with (address,
                     locality, base, length, rkey, runtime_info), then wait for "stop".
  {"role": "pull", "server": <serve's answer>, "blocks": [...], "locality": bool, "shift": int}
                     pull those remote blocks into consecutive local blocks (connecting with the
                     server's locality when asked), answer {"sha256", "path", "path_reason",
                     "info"}; then, for each further message (a list of blocks), pull again and
                     answer the same.
  {"role": "hold"}   a prefill that answers requests only when told: serve's answer, then for
                     each message {"cmd": "wait", "count": n}: wait until n requests are held,
                     answer their payloads; {"cmd": "reply", "count": n}: reply b"re:" + payload
                     to the first n held requests (all without count), answer "replied";
                     {"cmd": "stats"}: answer {"failed_replies", "reply_peers", "asan"} (asan:
                     libasan is mapped here); "stop": close, answer "closed".
  {"role": "request", "server": <serve's answer>, "payloads": [...]}
                     a decode: connect (UCX only), send one request per payload, wait for the
                     first one's reply, answer {"sent": n, "first": reply}, then wait for its
                     channel to close (tests kill it first).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.kv_transfer_peer import Channel

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32 << 10
NUM_BLOCKS = 64
SEED = 4321


@dataclass
class Proc:
    """A `tests.support.ucx_peer` process and its channel (the test side)."""

    popen: subprocess.Popen[str]
    ch: Channel

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(OSError):
                self.popen.kill()
        self.popen.wait(30)


def start(build_dir: Path | None, first: dict[str, Any], wrap: Any = None,
          env: dict[str, str] | None = None) -> Proc:
    """Start a peer process on the build in `build_dir` (None: the package's), send `first`.

    `wrap` rewrites the argv (e.g. to enter a namespace); `env` is added to this environment."""
    argv = [sys.executable, "-m", "tests.support.ucx_peer", str(build_dir or "-")]
    if wrap is not None:
        argv = wrap(argv)
    popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=ROOT, env={**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)})
    assert popen.stdin is not None and popen.stdout is not None
    proc = Proc(popen, Channel(popen.stdout, popen.stdin))
    proc.ch.send(first)
    return proc


def pattern(nbytes: int, seed: int = SEED) -> np.ndarray:
    """The server's bytes."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def expected_sha256(blocks: list[int]) -> str:
    """sha256 of the server's blocks `blocks`, concatenated."""
    src = pattern(NUM_BLOCKS * BLOCK).reshape(NUM_BLOCKS, BLOCK)
    return hashlib.sha256(src[np.asarray(blocks)].tobytes()).hexdigest()


def _serve(ch: Channel) -> None:
    from kernels import native
    from kvtransfer.transport import UcxEngine

    engine = UcxEngine(name="test-peer-server")
    buf = pattern(NUM_BLOCKS * BLOCK)
    region = engine.register(buf.ctypes.data, buf.nbytes, keepalive=buf)
    ch.send((engine.address, engine.locality, region.addr, region.length, region.rkey,
             native.runtime_info()))
    ch.recv()
    engine.close()


def _pull(ch: Channel, msg: dict[str, Any]) -> None:
    from kernels import native
    from kvtransfer.transport import UcxEngine

    address, locality, base, length, rkey, _info = msg["server"]
    engine = UcxEngine(name="test-peer-client")
    dst = np.zeros(NUM_BLOCKS * BLOCK, dtype=np.uint8)
    engine.register(dst.ctypes.data, dst.nbytes, keepalive=dst)
    peer = engine.connect(address, locality if msg["locality"] else None)
    rk = peer.unpack_rkey(rkey, base=base, length=length)
    blocks: list[int] = msg["blocks"]
    while True:
        dst[:] = 0
        ops = np.array([(dst.ctypes.data + i * BLOCK, base + b * BLOCK, BLOCK, rk)
                        for i, b in enumerate(blocks)], dtype=np.uint64)
        transfer = peer.get(ops)
        transfer.wait(30)
        got = dst[:len(blocks) * BLOCK].tobytes()
        ch.send({"sha256": hashlib.sha256(got).hexdigest(), "path": transfer.path,
                 "path_reason": peer.path_reason, "info": native.runtime_info()})
        try:
            blocks = ch.recv()
        except EOFError:
            break
    engine.close()


def _hold(ch: Channel) -> None:
    from kvtransfer.transport import UcxEngine

    engine = UcxEngine(name="test-peer-prefill")
    buf = pattern(NUM_BLOCKS * BLOCK)
    region = engine.register(buf.ctypes.data, buf.nbytes, keepalive=buf)
    ch.send((engine.address, engine.locality, region.addr, region.length, region.rkey, {}))
    held: list[Any] = []
    while True:
        msg = ch.recv()
        if msg == "stop":
            break
        if msg["cmd"] == "wait":
            deadline = time.monotonic() + 30
            while len(held) < msg["count"] and time.monotonic() < deadline:
                engine.wait_requests(0.05)
                held += engine.poll_requests()
            ch.send([req.payload for req in held])
        elif msg["cmd"] == "reply":
            count = msg.get("count", len(held))
            for req in held[:count]:
                req.reply(b"re:" + req.payload)
            held = held[count:]
            ch.send("replied")
        else:  # "stats"
            with open("/proc/self/maps") as maps:
                asan = "libasan" in maps.read()
            ch.send({"failed_replies": engine.failed_replies,
                     "reply_peers": engine.reply_peers, "asan": asan})
    engine.close()
    ch.send("closed")


def _request(ch: Channel, msg: dict[str, Any]) -> None:
    from kvtransfer.transport import UcxEngine

    address = msg["server"][0]
    engine = UcxEngine(name="test-peer-requester")
    peer = engine.connect(address)
    pending = [peer.request(payload) for payload in msg["payloads"]]
    pending[0].wait(30)
    ch.send({"sent": len(pending), "first": pending[0].result()})
    with contextlib.suppress(EOFError):
        ch.recv()
    engine.close()


def main() -> int:
    """Select the build named on the command line, then play the role of the first message."""
    ctl = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    if len(sys.argv) > 1 and sys.argv[1] != "-":
        from kernels import native

        native.select(sys.argv[1])
    ch = Channel(sys.stdin, ctl)
    msg = ch.recv()
    if msg["role"] == "serve":
        _serve(ch)
    elif msg["role"] == "hold":
        _hold(ch)
    elif msg["role"] == "request":
        _request(ch, msg)
    else:
        _pull(ch, msg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
