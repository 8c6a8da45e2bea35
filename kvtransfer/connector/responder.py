"""The prefill's answers to lease messages: releases and renewals from decodes.

Split from the worker half so the decision runs without torch or vLLM (the worker's responder
thread calls it; transport tests run it in a plain process). Each message is answered from the
``LeaseTable`` ("ok" / "expired", ``kvtransfer.protocol``), and the transport is told whether
the requester proved a lease (``Incoming.reply(vouched=)``): only then may it open a connection
to the address the request names (security review finding 15). Unknown messages get no answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvtransfer.leases import LeaseTable
from kvtransfer.protocol import RELEASE_EXPIRED, RELEASE_OK, parse_release, parse_renew

if TYPE_CHECKING:
    from kvtransfer.transport.base import Incoming

logger = logging.getLogger(__name__)


def answer_requests(requests: Iterable[Incoming], leases: LeaseTable,
                    lease_s: float) -> list[str]:
    """Answer every request; returns the ids of the leases a release ended "ok" (renewals
    extend a held lease by ``lease_s``)."""
    released = []
    for msg in requests:
        renewal = parse_renew(msg.payload)
        release = parse_release(msg.payload) if renewal is None else None
        if renewal is not None:
            answer = leases.renew(*renewal, time.monotonic() + lease_s)
        elif release is not None:
            answer = leases.release(*release, time.monotonic())
            if answer.ok:
                released.append(release[0])
            logger.debug("release of %s: %s", release[0], answer.value)
        else:
            # not a warning: any peer on the control channel could fill the log
            logger.debug("unknown message of %d bytes ignored", len(msg.payload))
            continue
        msg.reply(RELEASE_OK if answer.ok else RELEASE_EXPIRED, vouched=answer.vouched)
    return released
