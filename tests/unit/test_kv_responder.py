"""The prefill's answers to lease messages, and whom the transport may connect to for them."""

from __future__ import annotations

import time

from kvtransfer.connector.responder import answer_requests
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
        (release_message("never-granted", TOK), (b"ok", False)),  # early: proves nothing
        (renew_message("never-granted", TOK), (b"expired", False)),
        (b"not a lease message", None),  # never answered
    ]
    requests = [_Request(payload) for payload, _ in cases]
    assert answer_requests(requests, leases, lease_s=60.0) == ["held", "never-granted"]
    assert [r.replies for r in requests] == [[want] if want else [] for _, want in cases]
