"""The prefill's answers to lease messages: releases and renewals from decodes.

Split from the worker half so the decision runs without torch or vLLM (the worker's responder
thread drives it; transport tests run it in a plain process). Each message is answered from the
``LeaseTable`` ("ok" / "expired", ``kvtransfer.protocol``), and the transport is told whether
the requester proved a lease (``Incoming.reply(vouched=)``): only then may it open a connection
to the address the request names (security review finding 15). Unknown messages get no answer.

A release that arrives before its lease is granted (the grant comes one engine step after the
prefill finished; a fast decode can pull and release first) proves nothing yet: anyone can
make one up. Its answer waits until the grant carries the same token, then goes out vouched
for ("ok": the blocks could not have been freed before the grant). A made-up one is never
answered; at most ``max_waiting`` (65,536) wait, the oldest dropped first. Answering it at once
instead would reach only a decode the transport already holds a connection to: a new decode's
first early release would go unanswered and its pull be recomputed after ``pull_timeout_s``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvtransfer.leases import LeaseAnswer, LeaseTable
from kvtransfer.protocol import RELEASE_EXPIRED, RELEASE_OK, parse_release, parse_renew

if TYPE_CHECKING:
    from kvtransfer.transport.base import Incoming

logger = logging.getLogger(__name__)


class LeaseResponder:
    """Answers the lease messages a prefill's transport receives (see the module docstring)."""

    def __init__(self, leases: LeaseTable, lease_s: float, max_waiting: int = 65536) -> None:
        self.leases = leases
        self.lease_s = lease_s
        self.max_waiting = max_waiting
        self._waiting: OrderedDict[tuple[str, str], Incoming] = OrderedDict()
        self._last_held_s = float("-inf")

    @property
    def waiting(self) -> int:
        """Early releases whose answer waits for their grant."""
        return len(self._waiting)

    def expects_grant(self, now: float, within_s: float = 1.0) -> bool:
        """An early release arrived in the last ``within_s`` (monotonic ``now``) and still
        waits: its grant is due within an engine step or so (made-up ones never are)."""
        return bool(self._waiting) and now - self._last_held_s < within_s

    def answer(self, requests: Iterable[Incoming]) -> list[str]:
        """Answer every request (an early release: once granted); returns the ids of the
        leases a release ended "ok" (renewals extend a held lease by ``lease_s``)."""
        released = []
        for msg in requests:
            renewal = parse_renew(msg.payload)
            release = parse_release(msg.payload) if renewal is None else None
            if renewal is not None:
                answer = self.leases.renew(*renewal, time.monotonic() + self.lease_s)
            elif release is not None:
                answer = self.leases.release(*release, time.monotonic(), time.time())
                if answer.ok:
                    released.append(release[0])
                logger.debug("release of %s: %s", release[0], answer.value)
                if answer is LeaseAnswer.EARLY:
                    self._hold(release, msg)
                    continue
            else:
                # not a warning: any peer on the control channel could fill the log
                logger.debug("unknown message of %d bytes ignored", len(msg.payload))
                continue
            msg.reply(RELEASE_OK if answer.ok else RELEASE_EXPIRED, vouched=answer.vouched)
        return released

    def answer_granted(self) -> int:
        """Answer the early releases granted since the last call; returns how many."""
        answered = 0
        for key in self.leases.take_granted_early():
            msg = self._waiting.pop(key, None)
            if msg is not None:
                msg.reply(RELEASE_OK, vouched=True)
                answered += 1
        return answered

    def _hold(self, key: tuple[str, str], msg: Incoming) -> None:
        if len(self._waiting) >= self.max_waiting:  # a flood of made-up ids: oldest go first
            self._waiting.popitem(last=False)
        self._waiting[key] = msg
        self._last_held_s = time.monotonic()
