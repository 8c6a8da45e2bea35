"""The placement-policy seam shared by the router, the simulator and the tests.

A policy is pure: it sees plain values (the request's routing key, candidate snapshots) and
returns a decision. It never does I/O, never reads the clock or global randomness, and never
changes its own state while choosing. The caller reports what actually happened through
:meth:`PlacementPolicy.observe`, which is the only place a policy updates its state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may know about one request."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...] = ()
    """The rendered prompt's token ids, for prefix-aware policies; empty when not tokenized."""


@dataclass(frozen=True)
class Candidate:
    """A snapshot of one live worker offered to a policy."""

    worker_id: str
    in_flight: int = 0
    """Requests the router has dispatched to this worker and not yet seen finish."""
    recently_failed: bool = False
    """True while the worker is in its failure cool-down; policies should prefer others."""


@dataclass(frozen=True)
class Dispatched:
    """The router sent ``request_id`` (for ``model``) to ``worker_id``."""

    request_id: str
    worker_id: str
    model: str = ""


@dataclass(frozen=True)
class Finished:
    """``worker_id`` finished (or failed) ``request_id``."""

    request_id: str
    worker_id: str
    model: str = ""
    ok: bool = True


PolicyEvent = Dispatched | Finished


@runtime_checkable
class PlacementPolicy(Protocol):
    """Chooses one worker among candidates.

    Called by the router once per attempt, with the live workers of the request's model and role
    minus the ones already tried for this request. ``select`` must not mutate the policy;
    ``None`` means "no candidate" (the caller answers 503). ``observe`` is called by the router
    after each dispatch and each completion, in the order they happened.
    """

    name: str

    def select(
        self, request: RouteRequest, candidates: Sequence[Candidate]
    ) -> Candidate | None: ...

    def observe(self, event: PolicyEvent) -> None: ...


def preferred(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Candidates not in failure cool-down, or all of them when every one is cooling down."""
    healthy = [c for c in candidates if not c.recently_failed]
    return healthy or list(candidates)
