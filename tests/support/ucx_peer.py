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
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

import numpy as np

from bench.kv_transfer_peer import Channel

BLOCK = 32 << 10
NUM_BLOCKS = 64
SEED = 4321


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
    else:
        _pull(ch, msg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
