"""Placement: the one object the router and the simulator both drive to place requests.

It owns, per pool (``prefill``, ``decode``, ``aggregated``, ``flex``: whole requests on flex
workers), the policy, the membership the
policy was last told, the observers that follow the pool's events (selective
disaggregation's cache estimate) and the load ledger the pool's dispatches are counted in:

- ``sync(model, worker_ids)``: the live members; the policy hears ``Membership`` only on change;
- ``choose(request, candidates)``: the policy's :class:`~router.policy.base.Choice` (worker,
  reason, alternate), pure: nothing is recorded;
- ``begin(request, worker_id)``: the request was sent; the policy hears ``Dispatched``, the
  ledger counts it with its uncached prompt tokens (prefill roles), which are returned;
- ``end(request, worker_id, ok)``: it finished or failed; ``Finished``, and the ledger forgets it;
- ``plan_redispatch(sources, targets, load)``: which waiting requests should move to instances
  that joined or went idle, or off instances being removed (:func:`router.policy.rebalance.
  plan_redispatch`, with each request's cost on each target from the policy's cache estimate),
  pure; ``move(request, source, target)`` carries one out in the ledger and the policy's view
  (``end`` on the source, not ok, then ``begin`` on the target).

The caller owns the candidates' load snapshots and the ledger: the router's
:class:`~router.state.load.LoadTracker` and its reported worker loads, the simulator's
instances. Nothing here names a concrete policy; policies come from the registry by name.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol

from router.policy.base import (
    Candidate,
    Choice,
    Dispatched,
    Explaining,
    Finished,
    Membership,
    PlacementPolicy,
    PolicyEvent,
    PrefixAware,
    RouteRequest,
)
from router.policy.context import PolicyContext
from router.policy.load_model import LoadModel
from router.policy.rebalance import InstanceQueue, Move, QueuedRequest, plan_redispatch
from router.policy.registry import create_decode_policy, create_prefill_policy

PREFILL_ROLES = ("prefill", "aggregated", "flex")
"""Roles whose dispatches carry uncached prompt tokens in the ledger."""


class Ledger(Protocol):
    """Where a pool's dispatches are counted (the router's ``LoadTracker``)."""

    def start(self, worker_id: str, request_id: str | None = None, tokens: int = 0,
              *, prefill: bool = False) -> None: ...

    def finish(self, worker_id: str, request_id: str | None = None) -> None: ...


class Pool:
    """One role's placement: its policy, membership, observers and ledger."""

    def __init__(self, role: str, policy: PlacementPolicy, ledger: Ledger,
                 observers: tuple[Callable[[PolicyEvent], None], ...] = ()) -> None:
        self.role = role
        self.policy = policy
        self.ledger = ledger
        self.observers = observers
        self.prefill = role in PREFILL_ROLES
        self._members: dict[str, tuple[str, ...]] = {}
        self._prefix = policy if isinstance(policy, PrefixAware) else None
        self._explain = policy.choose if isinstance(policy, Explaining) else None
        self._name = policy.name

    def _tell(self, event: PolicyEvent) -> None:
        self.policy.observe(event)
        for observe in self.observers:
            observe(event)

    def tell(self, event: PolicyEvent) -> None:
        """Deliver an event from outside the request path (an engine's KV cache events,
        :class:`~router.policy.base.CacheChanged`) to the policy and the observers."""
        self._tell(event)

    def sync(self, model: str, worker_ids: Iterable[str]) -> bool:
        """Make ``worker_ids`` the members for ``model``; True when that changed them."""
        members = tuple(sorted(worker_ids))
        if self._members.get(model) == members:
            return False
        self._members[model] = members
        self._tell(Membership(model, members))
        return True

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Choice | None:
        """The policy's choice among ``candidates`` (None: no candidate). Records nothing."""
        if self._explain is not None:
            return self._explain(request, candidates)
        picked = self.policy.select(request, candidates)
        return None if picked is None else Choice(picked.worker_id, self._name)

    def cached_tokens(self, request: RouteRequest, worker_id: str) -> int:
        """Prompt tokens the policy expects ``worker_id`` to have cached (0 if it keeps no
        cache model)."""
        return 0 if self._prefix is None else self._prefix.cached_prefix_tokens(request,
                                                                                worker_id)

    def begin(self, request: RouteRequest, worker_id: str) -> int:
        """``request`` was sent to ``worker_id``; returns the uncached prompt tokens counted
        (0 on decode)."""
        tokens = 0
        if self.prefill:
            # asked before Dispatched, which records the prompt as cached there
            tokens = max(request.prompt_len - self.cached_tokens(request, worker_id), 0)
        self._tell(Dispatched(request.request_id, worker_id, request.model, request))
        self.ledger.start(worker_id, request.request_id, tokens, prefill=self.prefill)
        return tokens

    def end(self, request: RouteRequest, worker_id: str, ok: bool = True) -> None:
        """``worker_id`` finished (``ok``) or failed/gave up ``request``."""
        self._tell(Finished(request.request_id, worker_id, request.model, ok))
        self.ledger.finish(worker_id, request.request_id)


    def plan_redispatch(self, sources: Sequence[tuple[str, int, Sequence[tuple[RouteRequest,
                                                                            int]]]],
                        targets: Mapping[str, int], load: LoadModel,
                        evacuate: Collection[str] = (), max_moves: int = 64) -> list[Move]:
        """Moves of waiting requests (pure: nothing is recorded). ``sources`` are ``(worker_id,
        running tokens, [(request, its uncached tokens there)] waiting FIFO)``; ``targets``
        map each instance that may take work to the tokens already ahead of a newcomer there.
        A request's cost on a target is its prompt less what the policy expects cached there
        (a new instance: nothing)."""
        def queued(request: RouteRequest, tokens: int) -> QueuedRequest:
            there = {t: max(request.prompt_len - self.cached_tokens(request, t), 0)
                     for t in targets}
            return QueuedRequest(request.request_id, tokens, None, 0, there)

        queues = [InstanceQueue(wid, ahead, [queued(r, n) for r, n in waiting])
                  for wid, ahead, waiting in sources]
        return plan_redispatch(queues, targets, load, evacuate, max_moves)

    def move(self, request: RouteRequest, source: str, target: str) -> int:
        """Carry out a move of a waiting ``request``: ``source`` gave it up, ``target`` has
        it; returns the uncached tokens counted there."""
        self.end(request, source, ok=False)
        return self.begin(request, target)


class Placement:
    """The pools of one router or one simulated cluster."""

    def __init__(self, pools: Mapping[str, Pool]) -> None:
        self.pools = dict(pools)

    def pool(self, role: str) -> Pool:
        """The pool placing ``role`` requests."""
        return self.pools[role]

    @classmethod
    def create(cls, prefill: str, decode: str, context: PolicyContext,
               ledger: Ledger | Mapping[str, Ledger], *,
               prefill_params: Mapping[str, Any] | None = None,
               decode_params: Mapping[str, Any] | None = None,
               aggregated: bool = True,
               decode_observers: tuple[Callable[[PolicyEvent], None], ...] = ()) -> Placement:
        """Pools built from registry names: ``prefill`` (and, with ``aggregated``, its own
        instances of the same policy for aggregated workers and for whole requests on flex
        workers) and ``decode``. ``ledger`` is one
        for every pool or one per role."""
        def ledger_of(role: str) -> Ledger:
            return ledger[role] if isinstance(ledger, Mapping) else ledger

        pp = dict(prefill_params or {})
        pools = {
            "prefill": Pool("prefill", create_prefill_policy(prefill, context, **pp),
                            ledger_of("prefill")),
            "decode": Pool("decode",
                           create_decode_policy(decode, context, **dict(decode_params or {})),
                           ledger_of("decode"), decode_observers),
        }
        if aggregated:
            pools["aggregated"] = Pool("aggregated",
                                       create_prefill_policy(prefill, context, **pp),
                                       ledger_of("aggregated"))
            pools["flex"] = Pool("flex", create_prefill_policy(prefill, context, **pp),
                                 ledger_of("flex"))
        return cls(pools)
