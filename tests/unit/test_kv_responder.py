"""The prefill's answers to lease messages, and whom the transport may connect to for them."""

from __future__ import annotations

import time

from kvtransfer.connector.responder import LeaseResponder
from kvtransfer.leases import LeaseTable
from kvtransfer.protocol import release_message, renew_message

TOK = "secret-token-1"


class _Request:
    """An ``Incoming`` that records its answers."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.replies: list[tuple[bytes, bool]] = []

    def reply(self, payload: bytes, *, vouched: bool = True) -> None:
        self.replies.append((payload, vouched))


def test_each_message_is_answered_and_vouched_for_only_with_a_granted_token() -> None:
    """Review finding 15: the transport may connect to a requester (load its NIXL metadata,
    create a UCX reply endpoint) only when the request echoed a granted lease's token."""
    leases = LeaseTable()
    now = time.monotonic()
    leases.grant("held", now + 600.0, TOK, now)
    cases: list[tuple[bytes, tuple[bytes, bool] | None]] = [
        (release_message("held", "forged"), (b"expired", False)),
        (renew_message("held", "forged"), (b"expired", False)),
        (renew_message("held", TOK), (b"ok", True)),
        (release_message("held", TOK), (b"ok", True)),
        (release_message("held", TOK), (b"expired", True)),  # a repeat by the holder
        (renew_message("held", TOK), (b"expired", True)),
        (release_message("never-granted", TOK), None),  # early: proves nothing, not answered
        (release_message("never-granted", TOK), (b"expired", False)),  # a repeat: refused
        (renew_message("never-granted", TOK), (b"expired", False)),
        (b"not a lease message", None),  # never answered
    ]
    requests = [_Request(payload) for payload, _ in cases]
    responder = LeaseResponder(leases, lease_s=60.0)
    assert responder.answer(requests) == ["held", "never-granted"]
    assert [r.replies for r in requests] == [[want] if want else [] for _, want in cases]
    assert responder.waiting == 1 and responder.answer_granted() == 0


def test_an_early_release_is_answered_ok_and_vouched_once_its_grant_carries_its_token() -> None:
    """A decode that pulled and released before the prefill's grant gets its "ok" when the
    grant comes, vouched for (so a transport may connect to it: a new decode is answered, not
    left to recompute after its pull timeout). Controls: a grant with another token, and one of
    another id, answer nothing."""
    leases = LeaseTable()
    responder = LeaseResponder(leases, lease_s=60.0)
    early, forged, other = (_Request(release_message("r1", TOK)),
                            _Request(release_message("r2", "forged")),
                            _Request(release_message("r3", TOK)))
    assert responder.answer([early, forged, other]) == ["r1", "r2", "r3"]
    now = time.monotonic()
    assert responder.expects_grant(now) and not responder.expects_grant(now + 5.0)
    leases.grant("r2", now + 60.0, TOK, now)  # the real token is not the one released early
    leases.grant("r9", now + 60.0, TOK, now)
    assert responder.answer_granted() == 0
    assert early.replies == forged.replies == other.replies == []
    leases.grant("r1", now + 60.0, TOK, now)
    assert responder.answer_granted() == 1
    assert early.replies == [(b"ok", True)] and forged.replies == other.replies == []
    assert leases.take_finished() == {"r1"}  # the early release ended its lease at the grant
    assert responder.waiting == 2


def test_early_releases_waiting_for_a_grant_are_bounded() -> None:
    leases = LeaseTable()
    responder = LeaseResponder(leases, lease_s=60.0, max_waiting=3)
    requests = [_Request(release_message(f"made-up-{i}", TOK)) for i in range(10)]
    responder.answer(requests)
    assert responder.waiting == 3
    now = time.monotonic()
    leases.grant("made-up-0", now + 60.0, TOK, now)  # dropped from the waiting ones: unanswered
    leases.grant("made-up-9", now + 60.0, TOK, now)
    assert responder.answer_granted() == 1
    assert requests[9].replies == [(b"ok", True)] and requests[0].replies == []
