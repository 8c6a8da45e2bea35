"""Whom a NIXL engine answers and loads (security review finding 15), between real processes.

A spawned prefill runs a ``NixlEngine`` and the connector's own responder decision
(``kvtransfer.connector.responder.LeaseResponder`` over a ``LeaseTable``, as the worker's
responder thread runs it); the pytest process holds the decodes and the attackers, each a NIXL
agent of its own. Loading an agent's metadata opens endpoints to wherever it points, so the
prefill must load only requesters that proved a lease. Each attack has its control: the same
agent holding a real lease token is answered and loaded.

"No reply" is shown without a fixed wait: the prefill processes requests in order, so once the
control's reply (sent after the attack's decision) has arrived, an answer to the attack, had
one been sent, would have arrived first.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvtransfer.connector.responder import LeaseResponder
from kvtransfer.leases import LeaseTable
from kvtransfer.protocol import new_lease_token, release_message, renew_message
from kvtransfer.transport.base import Pending
from kvtransfer.transport.nixl import NixlEngine, decode_address, encode_address

DEADLINE_S = 20.0  # generous bound; never asserted as a duration
LEASE_S = 600.0
TOKEN = new_lease_token()
BLOCK = 32 << 10
NUM_BLOCKS = 128


def _prefill(conn: Any, max_loaded: int) -> None:
    """Prefill process: answer lease messages from a lease table the test grants into."""
    engine = NixlEngine(name="test-prefill", reads_expected=lambda: True,
                        max_loaded_agents=max_loaded)
    leases = LeaseTable()
    responder = LeaseResponder(leases, LEASE_S)
    handled = 0
    conn.send(engine.address)
    while True:
        while conn.poll(0):
            cmd, *args = conn.recv()
            if cmd == "stop":
                engine.close()
                return
            if cmd == "grant":
                now = time.monotonic()
                leases.grant(args[0], now + LEASE_S, args[1], now)
                conn.send(None)
            elif cmd == "stats":
                conn.send({"handled": handled, "loaded": engine.loaded_agents,
                           "strangers": engine.unanswered_strangers,
                           "foreign": engine.foreign_messages, "evicted": engine.evicted_agents,
                           "failed": engine.failed_replies, "dropped": engine.dropped_messages})
        responder.answer_granted()
        if engine.wait_requests(0.005):
            requests = engine.poll_requests()
            responder.answer(requests)
            handled += len(requests)


def _serve_memory(conn: Any) -> None:
    """Plain server process: register a patterned buffer and keep NIXL progressing."""
    engine = NixlEngine(name="test-memory", reads_expected=lambda: True)
    buf = np.arange(NUM_BLOCKS * BLOCK, dtype=np.uint64).astype(np.uint8)
    region = engine.register(buf.ctypes.data, buf.nbytes, keepalive=buf)
    conn.send((engine.address, buf.ctypes.data, buf.nbytes, region.rkey))
    while not (conn.poll(0) and conn.recv() == ("stop",)):
        engine.wait_requests(0.005)
    engine.close()


class Process:
    """A spawned NIXL process and its command pipe."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(60):
            self.proc.kill()
            pytest.fail("the process did not publish its NIXL address")
        self.hello = self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self.conn.send(("stop",))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


class Prefill(Process):
    def __init__(self, max_loaded: int) -> None:
        super().__init__(_prefill, max_loaded)
        self.address: bytes = self.hello
        self.name = decode_address(self.address)[0]

    def grant(self, request_id: str, token: str) -> None:
        self.conn.send(("grant", request_id, token))
        self.conn.recv()

    def stats(self) -> dict[str, Any]:
        self.conn.send(("stats",))
        stats: dict[str, Any] = self.conn.recv()
        return stats

    def wait_stats(self, done: Callable[[dict[str, Any]], bool],
                   *senders: NixlEngine) -> dict[str, Any]:
        """The prefill's counters once ``done`` holds for them (fails at the deadline);
        ``senders`` are progressed meanwhile (without a progress thread, a NIXL agent's
        notifications leave only while it is polled)."""
        deadline = time.monotonic() + DEADLINE_S
        while not done(stats := self.stats()):
            if time.monotonic() > deadline:
                pytest.fail(f"the prefill never got there: {stats}")
            for sender in senders:
                assert sender.poll_requests() == []
            time.sleep(0.001)
        return stats


@pytest.fixture
def start_prefill() -> Iterator[Callable[..., Prefill]]:
    started: list[Prefill] = []

    def start(max_loaded: int = 1024) -> Prefill:
        started.append(Prefill(max_loaded))
        return started[-1]

    yield start
    for prefill in started:
        prefill.stop()


@pytest.fixture
def agents() -> Iterator[Callable[..., NixlEngine]]:
    """NIXL engines in the pytest process (decodes, attackers, bystanders), closed after."""
    made: list[NixlEngine] = []

    def make(name: str, **kwargs: Any) -> NixlEngine:
        made.append(NixlEngine(name=name, **kwargs))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def _wait(pending: Pending) -> str:
    deadline = time.monotonic() + DEADLINE_S
    while (state := pending.poll()) == "pending" and time.monotonic() < deadline:
        time.sleep(0.0005)
    return state


def _answer(pending: Pending) -> bytes:
    assert _wait(pending) == "done", pending.error
    return pending.result()


def _wait_stopped(pid: int) -> None:
    """Until the kernel reports ``pid`` stopped (state T in /proc/<pid>/stat)."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.001)
    pytest.fail(f"process {pid} did not stop")


def _send_request(sender: NixlEngine, to: str, req_id: int, address: bytes,
                  payload: bytes) -> None:
    """A request notification as ``NixlEngine._request`` writes one, with any address."""
    message = b"Q" + struct.pack("!QI", req_id, len(address)) + address + payload
    sender._agent_call("send_notif", to, message)


def test_a_stranger_is_not_answered_and_never_loaded(
        start_prefill: Callable[..., Prefill], agents: Callable[..., NixlEngine]) -> None:
    """A peer without a lease token (made-up id, a real id with a made-up token, a renewal)
    gets no answer, and the prefill never loads its metadata, so never opens an endpoint to
    it. Control: the same agent with the real token is answered "ok" and loaded."""
    prefill = start_prefill()
    prefill.grant("r-held", TOKEN)
    stranger = agents("stranger")
    link = stranger.connect(prefill.address)
    attacks = [link.request(release_message("made-up", new_lease_token())),
               link.request(release_message("r-held", new_lease_token())),
               link.request(renew_message("r-held", new_lease_token()))]
    stats = prefill.wait_stats(lambda s: s["handled"] == 3, stranger)
    # the made-up release waits for a grant that never comes; the other two are refused and
    # their answers dropped
    assert stats["strangers"] == 2 and stats["loaded"] == [] and stats["failed"] == 0

    assert _answer(link.request(release_message("r-held", TOKEN))) == b"ok"  # control
    stats = prefill.stats()
    assert stats["loaded"] == [stranger.agent_name] and stats["strangers"] == 2
    assert [p.poll() for p in attacks] == ["pending"] * 3  # their answers would have come first
    # Once loaded (it proved a lease), a refusal reaches the agent; an early release is
    # answered when its grant carries its token, the made-up one still never.
    assert _answer(link.request(release_message("r-held", TOKEN))) == b"expired"
    early_token = new_lease_token()
    early = link.request(release_message("r-early", early_token))
    prefill.wait_stats(lambda s: s["handled"] == 6, stranger)
    assert early.poll() == "pending"
    prefill.grant("r-early", early_token)
    assert _answer(early) == b"ok"
    assert attacks[0].poll() == "pending"


def test_a_new_decodes_early_release_is_answered_at_its_grant(
        start_prefill: Callable[..., Prefill], agents: Callable[..., NixlEngine]) -> None:
    """A decode that pulled and released before the prefill's grant, and was never answered
    before (its agent not loaded), gets its "ok" once the grant carries its token: the grant
    vouches for it, so the prefill loads it to answer. Control: the same early release with
    another token than the grant's is never answered and nothing is loaded."""
    prefill = start_prefill()
    decode, liar = agents("decode"), agents("liar")
    token = new_lease_token()
    early = decode.connect(prefill.address).request(release_message("r-new", token))
    forged = liar.connect(prefill.address).request(release_message("r-new", new_lease_token()))
    prefill.wait_stats(lambda s: s["handled"] == 2, decode, liar)
    assert early.poll() == forged.poll() == "pending" and prefill.stats()["loaded"] == []
    prefill.grant("r-new", token)
    assert _answer(early) == b"ok"
    stats = prefill.stats()
    assert stats["loaded"] == [decode.agent_name] and stats["strangers"] == 0
    assert forged.poll() == "pending"


def test_a_request_naming_another_agent_than_its_sender_is_dropped(
        start_prefill: Callable[..., Prefill], agents: Callable[..., NixlEngine]) -> None:
    """A request whose address names a third agent (even with a real lease token) is dropped
    before the lease table sees it: the prefill loads nothing and the third agent hears
    nothing. Control: the same release with the sender's own address is answered."""
    prefill = start_prefill()
    prefill.grant("r-b", TOKEN)
    attacker, victim = agents("attacker"), agents("victim")
    link = attacker.connect(prefill.address)
    _send_request(attacker, prefill.name, 7, victim.address, release_message("r-b", TOKEN))
    stats = prefill.wait_stats(lambda s: s["foreign"] == 1, attacker)
    assert stats["handled"] == 0 and stats["loaded"] == []

    assert _answer(link.request(release_message("r-b", TOKEN))) == b"ok"  # control
    assert prefill.stats()["loaded"] == [attacker.agent_name]
    assert victim.poll_requests() == []
    assert victim.dropped_messages == 0 and victim.foreign_messages == 0  # no stray reply


def test_another_agents_metadata_under_the_senders_name_is_unloaded_at_once(
        start_prefill: Callable[..., Prefill], agents: Callable[..., NixlEngine]) -> None:
    """Even a lease holder cannot make the prefill keep a third agent loaded: an address
    naming the sender but carrying another agent's metadata is loaded, found to name someone
    else, and unloaded; the reply is not sent. Control: its own address is answered."""
    prefill = start_prefill()
    prefill.grant("r-c", TOKEN)
    holder, victim = agents("holder"), agents("victim")
    link = holder.connect(prefill.address)
    forged = encode_address(holder.agent_name, decode_address(victim.address)[1])
    _send_request(holder, prefill.name, 9, forged, renew_message("r-c", TOKEN))
    stats = prefill.wait_stats(lambda s: s["handled"] == 1, holder)
    assert stats["failed"] == 1 and stats["loaded"] == []

    assert _answer(link.request(renew_message("r-c", TOKEN))) == b"ok"  # control
    assert prefill.stats()["loaded"] == [holder.agent_name]


def test_replies_count_only_from_the_asked_agent_with_a_pending_id(
        agents: Callable[..., NixlEngine]) -> None:
    """Request ids are 64 random bits, and a reply is taken only from the agent its request
    went to: a peer that sprays guessed ids, or even knows the pending ones, answers nothing.
    Control: the asked agent's replies are each taken by their own request."""
    decode, asked, attacker = agents("decode"), agents("asked"), agents("attacker")
    link = decode.connect(asked.address)
    pendings = [link.request(b"done %d" % i) for i in range(32)]
    got: list[Any] = []
    deadline = time.monotonic() + DEADLINE_S
    while len(got) < len(pendings) and time.monotonic() < deadline:
        decode.poll_requests()  # progress the decode's side of the sends
        got += asked.poll_requests()
    ids = [r._req_id for r in got]
    assert len(set(ids)) == 32 and 0 not in ids
    assert max(ids) > 2**40  # sequential ids would all be below 33
    assert sum(b - a == 1 for a, b in zip(ids, ids[1:], strict=False)) == 0

    attacker.connect(decode.address)
    for guess in range(1, 65):  # what guessing sequential ids would try
        attacker._agent_call("send_notif", decode.agent_name,
                             b"R" + struct.pack("!Q", guess) + b"ok")
    for request in got:  # the real pending ids, from the wrong agent
        attacker._agent_call("send_notif", decode.agent_name,
                             b"R" + struct.pack("!Q", request._req_id) + b"ok")
    deadline = time.monotonic() + DEADLINE_S
    while decode.foreign_messages < 32 and time.monotonic() < deadline:
        attacker.poll_requests()  # progress the attacker's sends
        decode.poll_requests()
    assert decode.foreign_messages == 32 and decode.dropped_messages == 64
    assert [p.poll() for p in pendings] == ["pending"] * 32

    for request in got:  # control
        request.reply(b"re:" + request.payload)
    assert [_answer(p) for p in pendings] == [b"re:done %d" % i for i in range(32)]


def test_past_the_cap_the_oldest_agent_is_unloaded_and_reloads_when_vouched(
        start_prefill: Callable[..., Prefill], agents: Callable[..., NixlEngine]) -> None:
    """With room for two agents, the third proven requester unloads the least recently used;
    that one is a stranger again (unanswered without proof) until its next proven request,
    which loads it again and unloads the next oldest."""
    prefill = start_prefill(max_loaded=2)
    decodes = [agents(f"decode{i}") for i in range(3)]
    names = [d.agent_name for d in decodes]
    links = [d.connect(prefill.address) for d in decodes]
    tokens = [new_lease_token() for _ in decodes]
    for i, token in enumerate(tokens):
        prefill.grant(f"r{i}", token)

    def renew(i: int) -> bytes:
        return _answer(links[i].request(renew_message(f"r{i}", tokens[i])))

    assert renew(0) == renew(1) == b"ok"
    assert prefill.stats()["loaded"] == names[:2]
    assert renew(2) == b"ok"
    stats = prefill.stats()
    assert stats["loaded"] == names[1:] and stats["evicted"] == 1

    stray = links[0].request(renew_message("r0", new_lease_token()))  # refused: not vouched
    stats = prefill.wait_stats(lambda s: s["handled"] == 4, decodes[0])
    assert stats["strangers"] == 1 and stats["loaded"] == names[1:]
    assert renew(0) == b"ok"  # proven again: loaded again, decode1 (least recent) goes
    stats = prefill.stats()
    assert stats["loaded"] == [names[2], names[0]] and stats["evicted"] == 2
    assert stray.poll() == "pending"


def test_an_agent_with_a_read_in_flight_is_not_unloaded(
        monkeypatch: pytest.MonkeyPatch, agents: Callable[..., NixlEngine]) -> None:
    """Over UCX's tcp transport a READ needs the server's progress, so a stopped server keeps
    it in flight: loading another agent past the cap of one then keeps both (the busy one is
    never unloaded under its READ). Once the READ is done, the next load unloads both older
    agents, least recently used first, and the READ's bytes are right."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # for the spawned server and the engines made here
    server = Process(_serve_memory)
    try:
        address, base, length, rkey = server.hello
        name = decode_address(address)[0]
        reader = agents("reader", max_loaded_agents=1)
        other, third = agents("other"), agents("third")
        local = np.zeros(NUM_BLOCKS * BLOCK, dtype=np.uint8)
        reader.register(local.ctypes.data, local.nbytes, keepalive=local)
        link = reader.connect(address)
        index = link.unpack_rkey(rkey, base=base, length=length)
        ops = np.array([[local.ctypes.data, base, length, index]], dtype=np.uint64)
        pid = server.proc.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            _wait_stopped(pid)
            read = link.get(ops)
            assert read.poll() == "pending"
            reader.connect(other.address)
            assert reader.loaded_agents == [name, other.agent_name]
            assert reader.evicted_agents == 0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert _wait(read) == "done"
        expected = np.arange(NUM_BLOCKS * BLOCK, dtype=np.uint64).astype(np.uint8)
        assert np.array_equal(local, expected)
        reader.connect(third.address)
        assert reader.loaded_agents == [third.agent_name] and reader.evicted_agents == 2
    finally:
        server.stop()
