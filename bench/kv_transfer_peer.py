"""One side of a `bench.kv_transfer` pull, run as its own process (possibly in its own namespaces).

    python -m bench.kv_transfer_peer

The driver writes one spec to stdin and the side answers on stdout, each message one line of
base64-pickled data (stdout is reserved for that: fd 1 is pointed at stderr so that library
chatter cannot corrupt it). Roles:
  server  register `layers` patterned regions, send (address, locality, [(addr, rkey)]) — or
          NIXL's agent metadata and addresses — then wait for the client's "done".
  client  receive the server's message, pull `runs` once (warm-up, bytes checked), `repeats`
          timed times, then the small pull `small_repeats` times; send the result.
Backends: "ours" (kvtransfer.transport.UcxEngine with `engine_kwargs`), "sealed" (our sealed
tcp transport, kvtransfer.transport.tcp.TcpEngine, both sides proving one bench secret; the
server listens on `bind_host` and advertises `advertise_host`) and "nixl" (NIXL READ over its
UCX backend). UCX_* settings arrive in the environment, set by the driver.
"""

from __future__ import annotations

import base64
import os
import pickle
import sys
import time
from typing import IO, Any

import numpy as np

Run = tuple[int, int, int, int]  # (layer, local offset, remote offset, nbytes)


class Channel:
    """Line-framed pickles over a pair of pipes."""

    def __init__(self, rx: IO[str], tx: IO[str]) -> None:
        self._rx, self._tx = rx, tx

    def send(self, obj: object) -> None:
        """Write one message."""
        self._tx.write(base64.b64encode(pickle.dumps(obj)).decode() + "\n")
        self._tx.flush()

    def recv(self) -> Any:
        """Read one message (EOFError when the other side is gone)."""
        line = self._rx.readline()
        if not line:
            raise EOFError("peer closed the channel")
        return pickle.loads(base64.b64decode(line))


def fill(buf: np.ndarray, layer: int) -> None:
    """The server's bytes of `layer` (the client recomputes them to check what it pulled)."""
    buf[:] = np.random.default_rng(1000 + layer).integers(0, 256, buf.size, dtype=np.uint8)


def expected_checksum(region_bytes: int, runs: list[Run]) -> int:
    """Checksum of the remote bytes named by `runs` (layer-weighted byte sum)."""
    total = 0
    srcs: dict[int, np.ndarray] = {}
    for layer, _lo, ro, n in runs:
        if layer not in srcs:
            srcs[layer] = np.empty(region_bytes, np.uint8)
            fill(srcs[layer], layer)
        total += int(srcs[layer][ro:ro + n].astype(np.uint64).sum()) * (layer + 1)
    return total


def checksum(dsts: list[np.ndarray], runs: list[Run]) -> int:
    """Checksum of the local bytes named by `runs`."""
    return sum(int(dsts[layer][lo:lo + n].astype(np.uint64).sum()) * (layer + 1)
               for layer, lo, _ro, n in runs)


def _timed(once: Any, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return times


# --------------------------------------------------------------------------- ours


def _ours_server(ch: Channel, spec: dict[str, Any]) -> None:
    from kvtransfer.transport import UcxEngine

    _serve_regions(ch, spec, UcxEngine(name="bench-prefill", **spec["server_engine_kwargs"]))


def _serve_regions(ch: Channel, spec: dict[str, Any], engine: Any) -> None:
    """The server's part on any transport: register `layers` patterned regions, send their
    coordinates, wait for the client's "done", close ``engine``."""
    bufs, meta = [], []
    for layer in range(spec["layers"]):
        buf = np.empty(spec["region_bytes"], np.uint8)
        fill(buf, layer)
        reg = engine.register(buf.ctypes.data, buf.nbytes, keepalive=buf)
        bufs.append(buf)
        meta.append((reg.addr, reg.rkey))
    ch.send((engine.address, engine.locality, meta))
    ch.recv()  # the client is done
    engine.close()


def _ours_client(ch: Channel, spec: dict[str, Any]) -> None:
    from kvtransfer.transport import UcxEngine

    address, locality, meta = ch.recv()
    engine = UcxEngine(name="bench-decode", **spec["engine_kwargs"])
    _pull_and_report(ch, spec, engine, engine.connect(address, locality), meta)


def _pull_and_report(ch: Channel, spec: dict[str, Any], engine: Any, peer: Any,
                     meta: list[tuple[int, bytes]]) -> None:
    """The client's measurement on a connected transport (ours or sealed): warm-up pull with
    its bytes checked, timed pulls, the small pull; sends the result and closes ``engine``."""
    from kernels import native

    dsts = [np.ones(spec["local_region_bytes"], np.uint8) for _ in range(spec["layers"])]
    for d in dsts:
        engine.register(d.ctypes.data, d.nbytes, keepalive=d)
    rkeys = [peer.unpack_rkey(rk, base=addr, length=spec["region_bytes"]) for addr, rk in meta]

    def ops_of(runs: list[Run]) -> np.ndarray:
        return np.array([(dsts[layer].ctypes.data + lo, meta[layer][0] + ro, n, rkeys[layer])
                         for layer, lo, ro, n in runs], dtype=np.uint64)

    def pull(ops: np.ndarray) -> Any:
        transfer = peer.get(ops)
        transfer.wait(120)
        if transfer.poll() != "done":
            raise RuntimeError(f"pull failed: {transfer.error}")
        return transfer

    big, small = ops_of(spec["runs"]), ops_of(spec["small_runs"])
    warm = pull(big)
    ok = checksum(dsts, spec["runs"]) == expected_checksum(spec["region_bytes"], spec["runs"])
    times = _timed(lambda: pull(big), spec["repeats"])
    pull(small)
    small_ok = (checksum(dsts, spec["small_runs"])
                == expected_checksum(spec["region_bytes"], spec["small_runs"]))
    small_times = _timed(lambda: pull(small), spec["small_repeats"])
    ch.send({"ok": ok and small_ok, "times": times, "small_times": small_times,
             "ops": len(big), "path": getattr(warm, "path", None) or peer.path,
             "path_reason": peer.path_reason,
             "ucx": native.runtime_info() if spec["backend"] == "ours" else {}})
    engine.close()


# --------------------------------------------------------------------------- sealed tcp

SEALED_KEY = b"bench-only-secret-not-for-a-cluster"


def _sealed_server(ch: Channel, spec: dict[str, Any]) -> None:
    from kvtransfer.transport.tcp import TcpEngine

    _serve_regions(ch, spec, TcpEngine(name="bench-prefill", bind_host=spec["bind_host"],
                                       advertise_host=spec["advertise_host"],
                                       keys=lambda: [SEALED_KEY]))


def _sealed_client(ch: Channel, spec: dict[str, Any]) -> None:
    from kvtransfer.transport.tcp import TcpEngine

    address, _, meta = ch.recv()
    engine = TcpEngine(name="bench-decode", keys=lambda: [SEALED_KEY])
    _pull_and_report(ch, spec, engine, engine.connect(address), meta)


# --------------------------------------------------------------------------- NIXL


def _nixl_agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _nixl_server(ch: Channel, spec: dict[str, Any]) -> None:
    agent = _nixl_agent("prefill")
    bufs = []
    for layer in range(spec["layers"]):
        buf = np.empty(spec["region_bytes"], np.uint8)
        fill(buf, layer)
        bufs.append(buf)
    reg = agent.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in bufs], "DRAM")
    ch.send((agent.get_agent_metadata(), [b.ctypes.data for b in bufs]))
    ch.recv()
    agent.deregister_memory(reg)


def _nixl_client(ch: Channel, spec: dict[str, Any]) -> None:
    md, raddrs = ch.recv()
    agent = _nixl_agent("decode")
    peer = agent.add_remote_agent(md)
    dsts = [np.ones(spec["local_region_bytes"], np.uint8) for _ in range(spec["layers"])]
    reg = agent.register_memory([(d.ctypes.data, d.nbytes, 0, "") for d in dsts], "DRAM")

    def handle_of(runs: list[Run]) -> Any:
        local = agent.get_xfer_descs([(dsts[layer].ctypes.data + lo, n, 0)
                                      for layer, lo, _ro, n in runs], "DRAM")
        remote = agent.get_xfer_descs([(raddrs[layer] + ro, n, 0)
                                       for layer, _lo, ro, n in runs], "DRAM")
        return agent.initialize_xfer("READ", local, remote, peer)

    def once(handle: Any) -> None:
        state = agent.transfer(handle)
        deadline = time.monotonic() + 120
        while state not in ("DONE", "ERR"):
            if time.monotonic() > deadline:
                raise RuntimeError("NIXL transfer timed out")
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer state {state}")

    big, small = handle_of(spec["runs"]), handle_of(spec["small_runs"])
    once(big)
    ok = checksum(dsts, spec["runs"]) == expected_checksum(spec["region_bytes"], spec["runs"])
    times = _timed(lambda: once(big), spec["repeats"])
    once(small)
    small_ok = (checksum(dsts, spec["small_runs"])
                == expected_checksum(spec["region_bytes"], spec["small_runs"]))
    small_times = _timed(lambda: once(small), spec["small_repeats"])
    ch.send({"ok": ok and small_ok, "times": times, "small_times": small_times,
             "ops": len(spec["runs"]), "path": "nixl", "path_reason": None, "ucx": {}})
    for h in (big, small):
        agent.release_xfer_handle(h)
    agent.deregister_memory(reg)
    agent.remove_remote_agent(peer)


ROLES = {
    ("ours", "server"): _ours_server,
    ("ours", "client"): _ours_client,
    ("sealed", "server"): _sealed_server,
    ("sealed", "client"): _sealed_client,
    ("nixl", "server"): _nixl_server,
    ("nixl", "client"): _nixl_client,
}


def main() -> int:
    """Run the side named by the spec on stdin."""
    ctl = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything printed by libraries goes to stderr
    ch = Channel(sys.stdin, ctl)
    spec = ch.recv()
    if spec.get("native_build"):
        from kernels import native

        native.select(spec["native_build"])
    ROLES[(spec["backend"], spec["role"])](ch, spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
