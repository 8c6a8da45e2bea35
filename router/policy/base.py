"""The placement-policy seam shared by the router, the simulator and the tests.

A policy is pure: it sees plain values (the request's routing key, candidate snapshots) and
returns a decision. It never does I/O, never reads the clock or global randomness, and never
changes its own state while choosing. The caller reports what actually happened through
:meth:`PlacementPolicy.observe`, which is the only place a policy updates its state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    block_hashes: tuple[int, ...] = ()
    """Chained block hashes of the prompt (:mod:`router.policy.hashing`). Optional: prefix-aware
    policies hash ``prompt_token_ids`` themselves when this is empty; the simulator fills it
    directly (it models prompts as block hashes, not tokens)."""
    num_prompt_tokens: int = 0
    """Prompt length in tokens when ``prompt_token_ids`` is not given (simulator); 0 = use
    ``len(prompt_token_ids)``."""

    @property
    def prompt_len(self) -> int:
        """Prompt length in tokens."""
        return self.num_prompt_tokens or len(self.prompt_token_ids)


@dataclass(frozen=True)
class Candidate:
    """A snapshot of one live worker offered to a policy."""

    worker_id: str
    in_flight: int = 0
    """Requests the router has dispatched to this worker and not yet seen finish."""
    recently_failed: bool = False
    """True while the worker is in its failure cool-down; policies should prefer others."""
    pending_prefill_tokens: int = 0
    """Uncached prompt tokens dispatched to this worker and not finished (router accounting)."""
    running: int = 0
    """Sequences running on the worker (decode), e.g. ``vllm:num_requests_running``."""
    kv_usage: float = 0.0
    """Fraction of the worker's KV cache in use (``vllm:kv_cache_usage_perc``), 0 when unknown."""


@dataclass(frozen=True)
class Dispatched:
    """The router sent ``request_id`` (for ``model``) to ``worker_id``."""

    request_id: str
    worker_id: str
    model: str = ""
    request: RouteRequest | None = None
    """The routed request, so prefix-aware policies can record what the worker will cache."""


@dataclass(frozen=True)
class Finished:
    """``worker_id`` finished (or failed) ``request_id``."""

    request_id: str
    worker_id: str
    model: str = ""
    ok: bool = True


@dataclass(frozen=True)
class Membership:
    """The live workers of ``model`` for one role are now exactly ``worker_ids``.

    Sent by the caller when membership changes (join, leave, scale); ring-based policies update
    their rings here, so only keys whose candidates change move.
    """

    model: str
    worker_ids: tuple[str, ...]


@dataclass(frozen=True)
class CacheChanged:
    """``worker_id``'s engine reported a change of its prefix cache (its KV cache events,
    translated to our block hashes by :mod:`router.policy.kv_events`). Applied in this order:
    ``cleared`` (forget everything), ``removed`` (evicted), ``stored`` (now cached, in chain
    order). Only sent when the router follows the engines' events (``--kv-events``)."""

    worker_id: str
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    cleared: bool = False
    engine_block_tokens: int = 0
    """The engine's KV block size in tokens (0 = not said): it caches whole blocks only, so a
    dispatched prompt's trailing partial engine block is not recorded as cached."""


PolicyEvent = Dispatched | Finished | Membership | CacheChanged


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


@dataclass(frozen=True)
class Choice:
    """A placement decision: the worker, why (a bounded metric label), and the runner-up the
    policy would move the request to (DualMap's other candidate; None when it has none)."""

    worker: str
    reason: str
    alternate: str | None = None


@runtime_checkable
class Explaining(Protocol):
    """Optional extension: a policy that says why it chose (``Choice.reason``) and which
    candidate came second (``Choice.alternate``). Pure, like ``select``."""

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Choice | None: ...


@runtime_checkable
class PrefixAware(Protocol):
    """Optional extension: a policy that models what each worker has cached.

    The router asks it, after ``select``, how many of the request's prompt tokens it expects
    ``worker_id`` to find cached, so its in-flight accounting counts only uncached tokens
    (``Candidate.pending_prefill_tokens``). Pure query, no state change.
    """

    def cached_prefix_tokens(self, request: RouteRequest, worker_id: str) -> int: ...


class LoadOrdered(Sequence[Candidate]):
    """A candidate sequence that keeps itself ordered by load (the simulator's heap-ordered
    decode pool: 1,000 instances, one choice per request). Its candidates are never in
    cool-down and report no KV usage. A base class, not a protocol: the decode policy checks
    it on every choice and a runtime protocol check costs ~20 us."""

    def least_loaded(self) -> Candidate | None:
        """The candidate with the lowest ``(max(running, in_flight), in_flight, worker_id)``;
        None when empty."""
        raise NotImplementedError


def index_candidates(candidates: Sequence[Candidate]) -> Mapping[str, Candidate]:
    """``worker_id -> Candidate``; uses the sequence's own ``by_id`` index when it has one
    (:class:`CandidatePool`, the simulator's lazy pool) so large pools are not re-indexed."""
    by_id = getattr(candidates, "by_id", None)
    if by_id is not None:
        return by_id  # type: ignore[no-any-return]
    return {c.worker_id: c for c in candidates}


class CandidatePool(Sequence[Candidate]):
    """An immutable candidate list that carries its ``worker_id`` index (built once)."""

    def __init__(self, candidates: Sequence[Candidate]) -> None:
        self._items = tuple(candidates)
        self.by_id: Mapping[str, Candidate] = {c.worker_id: c for c in self._items}
        self.any_failed = any(c.recently_failed for c in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):  # type: ignore[no-untyped-def,override]
        return self._items[i]

    def __iter__(self):  # type: ignore[no-untyped-def,override]
        return iter(self._items)


def preferred(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Candidates not in failure cool-down, or all of them when every one is cooling down."""
    healthy = [c for c in candidates if not c.recently_failed]
    return healthy or list(candidates)
