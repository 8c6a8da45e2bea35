"""Adaptive disaggregation: the path of each request, chosen from predicted TTFT and TPOT (pure).

For every request the router hands :class:`AdaptivePaths` the live engines (flex workers can
serve whole, prefill or decode; prefill, decode and aggregated workers what their role allows)
and it plans (:mod:`router.policy.path_cost`):

1. whole on an engine where it meets both SLOs without pushing the requests already decoding
   there past the TPOT SLO: the one with the most of the prompt cached, then the fewest expected
   misses (``PlanEstimate.expected_misses``: its stall risk priced), then the least loaded by
   its worst SLO ratio (``whole_meets_slo``; a whole request costs one engine, P/D two);
2. else P/D between the best two prefill and best two decode engines, if one pair meets them;
   the reason is why the best whole plan did not (``whole_misses_ttft``, ``whole_misses_tpot``,
   ``whole_harms_admitted``);
3. else the plan with the fewest expected misses, then the lowest worst-SLO ratio
   (``best_effort``). "Best" is this order wherever plans are compared.

With ``defer`` (the router's ``--hold-prefills``, on by default) the rule is one step instead
(:meth:`AdaptivePaths.decide_held`): every plan above may also be *held*, the request kept in
the router until the answers its prefill would push past the TPOT have ended
(:func:`~router.policy.path_cost.estimate_whole_deferred`; the router releases it when they end,
``router.api.holds``). The plan taken is the one that meets both SLOs and pushes no admitted
answer past the TPOT, sent now or held (the most of the prompt cached, whole before P/D, the
earliest first token); else the fewest expected misses among the plans sent now and the held
ones still within the TTFT (``best_effort``). A short answer's decode then runs between two
engines' prefills instead of under one: both engines keep prefilling, and no engine is set
aside as a quiet decoder (the split below is not consulted).

Costs start from :class:`~router.policy.path_cost.PathCosts` (defaults or a ``pdserve bench
profile``) and are calibrated online: ``learn`` moves a prefill scale and a decode scale toward
observed/predicted TTFT and TPOT of each streamed request (exponential average, weight 0.1).

State, updated only through ``dispatched``/``prefilled``/``released``/``finished``/``learn``
with the caller's clock and measurements (nothing here reads a clock): a virtual prefill queue
per engine (the DualMap-style TTFT estimate), kept as a schedule of its booked prefills: the
ones sent run in the order sent, each from the heard end of the one before; a held request's
runs once it is sent and those before it have run, so a request sent meanwhile is planned
behind the sent ones only (it reaches the engine first); the decayed count and seconds of the
prefills each engine was given (their rate and mean length over the last ``share_window_s``),
the sequences each engine decodes with their expected output lengths and the prefill stall per
token added to each since it started, and a prefix-cache estimate per engine (every prompt it
prefilled or pulled).

Because the split is decided per request from this state, the share of the fleet prefilling and
decoding follows the load: a burst of long prompts raises the engines' queues and prefill rates
until whole plans miss (their tail TPOT, or the stall they add to admitted short answers) and
P/D moves the decodes to the engines prefilling least; long generations with few prefills make
whole plans the cheaper ones again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from router.policy.base import Candidate, RouteRequest
from router.policy.cache_model import DEFAULT_CAPACITY_BLOCKS, PrefixCacheModel
from router.policy.hashing import DEFAULT_BLOCK_TOKENS
from router.policy.path_cost import (
    EngineLoad,
    PathCosts,
    PlanEstimate,
    decode_stall,
    decode_tpot,
    estimate_pd,
    estimate_pd_deferred,
    estimate_whole,
    estimate_whole_deferred,
    token_intervals,
)

CAPABILITIES: dict[str, tuple[bool, bool, bool]] = {
    "flex": (True, True, True),
    "aggregated": (True, False, False),
    "prefill": (False, True, False),
    "decode": (True, False, True),
}
"""Role -> (whole, prefill, decode): what an engine of that role may do in a plan."""

TPOT_MARGIN = 0.8
"""Plans aim for this fraction of the TPOT SLO: the tail model is approximate (a chunked
iteration may carry several prefills). Chosen in ``pdserve sim paths`` on the mix workload,
seed 0 (0.6-1.0 tried); the other workloads and seeds were not used to pick it."""
MIN_SENSITIVE_REQUESTS = 2.0
"""Stall-sensitive requests (decayed over ``share_window_s``) below which no engine is kept
quiet: about one every 5 s with the default 10 s window. Chosen by reasoning (a reservation for
a lone request costs a whole engine's prefill capacity for a window), not fitted to a trace."""
MIN_QUIET_SHARE = 0.5
"""The split reserves a further quiet decoder only while the stall-sensitive share of recent
requests times the engines that can decode reaches the reserved count + 1 - this: k of N
engines kept quiet for a share s of the requests, rounded (with 2 engines the first needs a
quarter of the requests). Chosen by reasoning, not fitted."""
LEARNING_RATE = 0.1
"""Weight of one observed request in the learned cost scales (an exponential average)."""
MIN_LEARN_S = 0.005
"""TTFT predictions shorter than this teach nothing (HTTP and scheduling noise dominate them)."""
MIN_LEARN_TPOT_S = 0.001
"""TPOT predictions shorter than this teach nothing. A TPOT is a mean over the answer's gaps,
with no request overhead in it: a decode step of a few ms is a real measurement."""
SCALE_LIMITS = (0.1, 10.0)
"""The learned scales stay within these factors of the starting costs."""
MAX_LEARN_WAIT = 0.25
"""The prefill scale learns from a request only when the wait before its own prefill was
predicted under this share of its TTFT (:meth:`AdaptivePaths.learn`)."""

REASONS = ("whole_meets_slo", "whole_misses_ttft", "whole_misses_tpot", "whole_harms_admitted",
           "best_effort", "forced", "no_pd_pair", "stall_sensitive", "split", "split_relief",
           "held", "pd_meets_slo")
"""Every ``reason`` a decision may carry (bounded metric labels)."""

FORCED_PATHS = ("whole", "pd")


@dataclass(frozen=True)
class PathDecision:
    """The plan taken, why, and the best plan of the other kind (None: there was none)."""

    plan: PlanEstimate
    reason: str
    other: PlanEstimate | None = None
    sensitive: bool = False
    """Its TPOT holds on a quiet decoder but not on any engine that also prefills: it counts
    toward the quiet decoders the split keeps (``dispatched``), on whatever path it took."""


@dataclass
class _Booking:
    """One prefill booked on an engine: how long it runs, when it reaches the engine (a held
    request: when the router is expected to send it) and, as last scheduled, its start and
    end."""

    seconds: float
    release_s: float
    released: bool
    start_s: float = 0.0
    end_s: float = 0.0


@dataclass
class _Engine:
    booked: dict[str, _Booking] = field(default_factory=dict)
    """Request id -> its prefill on this engine, until the router hears it ended
    (:meth:`AdaptivePaths.prefilled`); the ones sent in the order they were sent."""
    done_s: float = 0.0
    """When the engine's last heard prefill ended: the earliest its next one starts."""
    sent_until_s: float = 0.0
    """When the prefills already sent to it end (as last scheduled)."""
    busy_until_s: float = 0.0
    """When every booked prefill ends, the held ones included (as last scheduled)."""
    share_s: float = 0.0
    """Prefill seconds dispatched, decayed to ``share_at_s``."""
    count: float = 0.0
    """Prefills dispatched, decayed to ``share_at_s``."""
    pushing: float = 0.0
    """Prefills dispatched that pushed an answer past the TPOT target (sent now by a plan
    that met nothing), decayed to ``share_at_s``: the landings a held plan's answer is exposed
    to."""
    square_s: float = 0.0
    """Sum of the squared prefill seconds, decayed to ``share_at_s``."""
    share_at_s: float = 0.0
    decoding: dict[str, list[float]] = field(default_factory=dict)
    """Request id -> [its expected output tokens, the prefill stall per token added to it, when
    it starts decoding (its prefill's predicted end)]."""


def _typical_prefill_s(engines: Sequence[EngineLoad]) -> float:
    """The length of the prefill a decode step is likely to find running in this fleet: the
    engines' size-biased means weighted by their prefill rates (0 when none ran lately)."""
    rate = sum(e.prefill_rate for e in engines)
    if rate <= 0:
        return 0.0
    return sum(e.prefill_rate * e.mean_prefill_s for e in engines) / rate


def _ends_s(admitted: list[float], step_s: float) -> float:
    """When a sequence of ``_Engine.decoding`` sends its last token: its start, then its
    token gaps at ``step_s`` plus the stall per token added to it."""
    return admitted[2] + token_intervals(admitted[0]) * (step_s + admitted[1])


def _admitted_now(decoding: Iterable[list[float]], step_s: float, now_s: float
                  ) -> tuple[tuple[tuple[float, float, float], ...], tuple[float, ...]]:
    """``EngineLoad.admitted`` and ``admitted_ends_s`` of an engine's ``_Engine.decoding`` at
    ``now_s``: each sequence's (output tokens, stall per token, seconds until it starts
    decoding) and seconds until its last token (:func:`_ends_s`; infinite once it outlived
    that prediction: its decode ran slower than predicted, by an unknown amount, and no plan
    waits for it). One pass: the router and the simulator
    run this for every engine and every request in flight at each decision."""
    admitted = []
    ends = []
    for out, stall, start in decoding:
        starts_in = start - now_s
        admitted.append((out, stall, 0.0 if starts_in < 0.0 else starts_in))
        left = start + token_intervals(out) * (step_s + stall) - now_s  # _ends_s - now
        ends.append(left if left > 0 else math.inf)
    return tuple(admitted), tuple(ends)


HOLD_SLACK = 1.0
"""A held request waits at most its predicted hold plus this fraction of it (and at least
:data:`HOLD_SLACK_MIN_S` more): answers that run far past their predicted end decode slower
than the model knows, and waiting for them would only spend the request's TTFT."""
HOLD_SLACK_MIN_S = 0.05


def hold_limit_s(plan: PlanEstimate, ttft_slo_s: float) -> float:
    """How long a held ``plan`` waits at most for the answers it waits for: its predicted hold
    with slack (:data:`HOLD_SLACK`), never past the moment its own TTFT would miss."""
    latest = ttft_slo_s - (plan.ttft_s - plan.hold_s)
    return min(plan.hold_s * (1 + HOLD_SLACK) + HOLD_SLACK_MIN_S, max(latest, plan.hold_s))


class AdaptivePaths:
    """Chooses whole or P/D per request; remembers what it dispatched where."""

    def __init__(self, costs: PathCosts, ttft_slo_s: float, tpot_slo_s: float, *,
                 tpot_margin: float = TPOT_MARGIN, share_window_s: float = 10.0, top_k: int = 2,
                 capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
                 block_tokens: int = DEFAULT_BLOCK_TOKENS, defer: bool = False) -> None:
        if ttft_slo_s <= 0 or tpot_slo_s <= 0 or share_window_s <= 0 or top_k < 1:
            raise ValueError("SLOs and share_window_s must be > 0 and top_k >= 1")
        self.costs = costs
        self.ttft_slo_s = ttft_slo_s
        self.tpot_slo_s = tpot_slo_s * tpot_margin
        """The TPOT the plans aim for: the SLO x ``tpot_margin``."""
        self.material_s = tpot_slo_s - self.tpot_slo_s
        """The least stall per token a prefill must add to an admitted answer to count against
        it (to push it past the TPOT target, or to make a plan wait for it): the margin between
        the SLO and the target. A smaller stall alone cannot take an answer that met the target
        past the SLO, and waiting for such answers cost the waiting requests more than the
        stall would have: on decode_heavy (150-token prompts, 13-256-token answers, a stall of
        a few ms per token) held plans lost to DualMap's sent-at-once ones by 12 / 31 requests,
        and never holding was level with it (README, "When does P/D pay"). A 1,500-token prompt
        over a 12-token answer stalls it ~25 ms per token: that is still waited for."""
        self.share_window_s = share_window_s
        self.top_k = top_k
        self.capacity_blocks = capacity_blocks
        self.block_tokens = block_tokens
        self.defer = defer
        """Plans may be held until the answers they would stall have finished
        (:meth:`decide_held`)."""
        self._engines: dict[str, _Engine] = {}
        self._caches: dict[str, PrefixCacheModel] = {}
        self._requests: dict[str, tuple[str, ...]] = {}
        """Request id -> the engines it occupies (decode engine first)."""
        self._prefilling: dict[str, str] = {}
        """Request id -> the engine prefilling it, until the router hears it prefilled
        (:meth:`prefilled`); its prefill's predicted end is its decoding entry's start."""
        self._sensitive_tokens = 0.0
        """Output tokens of stall-sensitive requests, decayed like the prefill counts."""
        self._sensitive_requests = 0.0
        """Stall-sensitive requests, decayed like the prefill counts."""
        self._sensitive_at_s = 0.0
        self._all_requests = 0.0
        """Every request dispatched, decayed like the sensitive count (same stamp)."""
        self.reserved: tuple[str, ...] = ()
        """Engines kept quiet for stall-sensitive decodes (the split's decode side)."""
        self.base_costs = costs
        self.prefill_scale = 1.0
        """Observed / predicted TTFT, averaged: scales the prefill costs."""
        self.decode_scale = 1.0
        """Observed / predicted TPOT, averaged: scales the decode step costs."""

    # -- state -> EngineLoad ------------------------------------------------------------------

    def _decay(self, since_s: float, now_s: float) -> float:
        """The factor a sum stamped at ``since_s`` decays by until ``now_s`` (exponential, the
        window as time constant): the engines' prefill sums and the sensitive demand."""
        return math.exp(-max(now_s - since_s, 0.0) / self.share_window_s)

    def _prefill_seconds(self, worker_id: str, now_s: float) -> float:
        """Prefill seconds dispatched to ``worker_id`` lately, decayed to ``now_s``."""
        engine = self._engines.get(worker_id)
        return 0.0 if engine is None else engine.share_s * self._decay(engine.share_at_s, now_s)

    def cached_tokens(self, request: RouteRequest, worker_id: str) -> int:
        """Tokens of ``request``'s prompt ``worker_id`` is estimated to hold."""
        cache = self._caches.get(worker_id)
        if cache is None or not request.block_hashes:
            return 0
        return min(cache.match(request.block_hashes) * self.block_tokens, request.prompt_len)

    def loads(self, request: RouteRequest, engines: Iterable[tuple[str, Candidate]],
              now_s: float) -> list[EngineLoad]:
        """:class:`EngineLoad` of each ``(role, candidate)`` for ``request`` at ``now_s``."""
        engines = list(engines)
        self._resize_split(engines, now_s)
        out = []
        for role, c in engines:
            whole, prefill, decode = CAPABILITIES[role]
            engine = self._engines.get(c.worker_id) or _Engine()
            self._schedule(engine, now_s)
            decay = self._decay(engine.share_at_s, now_s)
            running = max(c.running, len(engine.decoding))
            step = self.costs.step_s(running)
            admitted, ends_s = _admitted_now(engine.decoding.values(), step, now_s)
            out.append(EngineLoad(
                worker_id=c.worker_id, whole=whole, prefill=prefill, decode=decode,
                queued_s=max(engine.sent_until_s - now_s, 0.0),
                booked_s=max(engine.busy_until_s - now_s, 0.0),
                running=running,
                # held plans: only the prefills sent past the answers they stall land on one
                prefill_rate=(engine.pushing if self.defer else engine.count) * decay
                / self.share_window_s,
                mean_prefill_s=engine.square_s / engine.share_s if engine.share_s > 1e-12
                else 0.0,
                cached_tokens=self.cached_tokens(request, c.worker_id),
                admitted_output_tokens=min([a[0] for a in admitted]) if admitted else 0.0,
                admitted_stall_s=max([a[1] for a in admitted]) if admitted else 0.0,
                admitted=admitted, admitted_ends_s=ends_s, admitted_ids=tuple(engine.decoding),
                recently_failed=c.recently_failed, reserved=c.worker_id in self.reserved))
        return out

    # -- the split --------------------------------------------------------------------------

    def quiet_decoders_needed(self, now_s: float) -> int:
        """Quiet decoders the recent stall-sensitive decodes need: none while they are rare
        (:data:`MIN_SENSITIVE_REQUESTS`), else their tokens per second over what one decoder
        streams within the planned TPOT, and at least one. A quiet decoder is isolation from
        prefills, which a short answer needs however few tokens it asks for (counting tokens
        alone kept none for 12-token answers behind 1,500-token prompts, and every decoder
        kept prefilling: 1P+1D sustained twice adaptive's rate on the switching trace)."""
        decay = self._decay(self._sensitive_at_s, now_s)
        if self._sensitive_requests * decay < MIN_SENSITIVE_REQUESTS:
            return 0
        demand = self._sensitive_tokens * decay / self.share_window_s  # tokens/s
        batch = 1
        while batch < 256 and self.costs.step_s(batch + 1) <= self.tpot_slo_s:
            batch += 1
        capacity = batch / self.costs.step_s(batch)  # tokens/s of one quiet decoder
        return max(1, math.ceil(demand / capacity))

    def _resize_split(self, engines: list[tuple[str, Candidate]], now_s: float) -> None:
        """Keep :meth:`quiet_decoders_needed` engines reserved (at most all but one of the
        engines that can prefill or serve whole; more only while the others stay under 70 %
        prefill load and the sensitive share fills them, :data:`MIN_QUIET_SHARE`): the ones
        already reserved first, then the quietest. This is the control rule by which the split
        follows the load."""
        can_decode = [c.worker_id for role, c in engines
                      if CAPABILITIES[role][2] and CAPABILITIES[role][0]]
        others = sum(1 for role, _ in engines if CAPABILITIES[role][0] or CAPABILITIES[role][1])
        # the engines left prefilling must keep their prefill utilisation under 70 %
        prefill_load = sum(self._prefill_seconds(c.worker_id, now_s)
                           for _, c in engines) / self.share_window_s
        room = others - math.ceil(prefill_load / 0.7)
        # the cap binds growth only: a reserved decoder stays reserved while the demand lasts
        # (dropping it in a burst of prefills turned it into a prefiller under the stall-sensitive
        # decodes it still ran: on the 2-engine box 32 of 81 whole plans landed there, 14 missed)
        need = min(self.quiet_decoders_needed(now_s), len(can_decode), others - 1)
        kept = sum(1 for w in self.reserved if w in can_decode)
        # growth also needs a sensitive share that fills the engines it takes, to half an
        # engine: while the split holds every request goes P/D, so a few sensitive requests
        # must not turn a fleet of whole-serving engines into P/D pools
        fills = math.floor(self.sensitive_share(now_s) * len(can_decode) + MIN_QUIET_SHARE)
        want = max(min(need, max(min(room, fills), kept)), 0)

        def quietness(worker_id: str) -> tuple[bool, float, str]:
            return (worker_id not in self.reserved, self._prefill_seconds(worker_id, now_s),
                    worker_id)

        self.reserved = tuple(sorted(sorted(can_decode, key=quietness)[:want]))

    def sensitive_share(self, now_s: float) -> float:
        """The stall-sensitive share of the requests dispatched lately (decayed alike)."""
        decay = self._decay(self._sensitive_at_s, now_s)
        total = self._all_requests * decay
        return self._sensitive_requests * decay / total if total > 1e-12 else 0.0

    # -- the decision ---------------------------------------------------------------------------

    def plans(self, request: RouteRequest, output_tokens: int, engines: Sequence[EngineLoad]
              ) -> tuple[list[PlanEstimate], list[PlanEstimate]]:
        """(whole plans, P/D plans) over ``engines`` (engines in failure cool-down only when
        no other can take that part)."""
        healthy = [e for e in engines if not e.recently_failed] or list(engines)
        n, out = request.prompt_len, output_tokens
        # reserved (quiet) decoders prefill nothing while another engine can
        open_ = [e for e in healthy if not e.reserved]
        whole = [estimate_whole(self.costs, n, out, e, self.material_s)
                 for e in ([e for e in open_ if e.whole] or [e for e in healthy if e.whole])]
        prefillers = [e for e in open_ if e.prefill] or [e for e in healthy if e.prefill]
        # prefillers by their TTFT, then by the decoding they would stall
        by_ttft = sorted(prefillers,
                         key=lambda e: (e.queued_s + self.costs.prefill_s(n - e.cached_tokens),
                                        e.running, e.worker_id))[:self.top_k]
        by_tpot = sorted((e for e in healthy if e.decode),
                         key=lambda e: (decode_tpot(self.costs, e, out), e.worker_id)
                         )[:self.top_k]
        pd = [estimate_pd(self.costs, n, out, p, d, self.material_s)
              for p in by_ttft for d in by_tpot
              if p.worker_id != d.worker_id]
        return whole, pd

    def quiet_plans(self, request: RouteRequest, output_tokens: int,
                    engines: Sequence[EngineLoad]) -> list[PlanEstimate]:
        """The plans :meth:`plans` leaves out: those that prefill on a reserved (quiet)
        decoder, whole there or P/D onto the best other decoders."""
        n, out = request.prompt_len, output_tokens
        quiet = [e for e in engines if e.reserved and not e.recently_failed]
        decoders = sorted((e for e in engines if e.decode and not e.recently_failed),
                          key=lambda e: (decode_tpot(self.costs, e, out), e.worker_id))
        plans = [estimate_whole(self.costs, n, out, e, self.material_s)
                 for e in quiet if e.whole]
        for p in (e for e in quiet if e.prefill):
            plans += [estimate_pd(self.costs, n, out, p, d, self.material_s)
                      for d in [d for d in decoders if d.worker_id != p.worker_id][:self.top_k]]
        return plans

    def decide(self, request: RouteRequest, output_tokens: int, engines: Sequence[EngineLoad],
               force: str | None = None) -> PathDecision | None:
        """The plan for ``request`` (``output_tokens`` expected) among ``engines``; ``force``
        (``whole`` or ``pd``) restricts it to that kind when one exists. None: no engine."""
        whole, pd = self.plans(request, output_tokens, engines)
        slo = (self.ttft_slo_s, self.tpot_slo_s)
        by_id = {e.worker_id: e for e in engines}

        def best(plans: list[PlanEstimate]) -> PlanEstimate | None:
            # the fewest requests expected past an SLO (its own stall risk priced, not
            # rounded away by the quantile), then the lowest worst-SLO ratio
            return min(plans, key=lambda p: (round(p.expected_misses(*slo), 2), p.badness(*slo),
                                             p.worker, p.prefill_worker or ""), default=None)

        best_whole, best_pd = best(whole), best(pd)
        if force in FORCED_PATHS:
            forced, other = (best_whole, best_pd) if force == "whole" else (best_pd, best_whole)
            if forced is not None:
                return PathDecision(forced, "forced", other)
        if best_whole is None and best_pd is None:
            return None
        if self.defer:
            return self.decide_held(request, output_tokens, engines, whole, pd)
        if best_pd is None:
            assert best_whole is not None
            return PathDecision(best_whole, "no_pd_pair")
        if best_whole is None:
            return PathDecision(best_pd, "no_pd_pair")
        quiet_plans = self.quiet_plans(request, output_tokens, engines) \
            if any(e.reserved for e in engines) else []
        # a prompt short enough is served whole on a quiet decoder: no hop, no wait behind the
        # long prompts (:meth:`quiet_whole_fits`), when no answer decoding there by the time
        # its prefill ends is pushed past the TPOT (answers still waiting for their prefill on
        # another engine are not stalled by it)
        quiet_whole = best([p for p in quiet_plans if p.path == "whole"
                            and p.ttft_s <= self.ttft_slo_s and p.tpot_s <= self.tpot_slo_s
                            and not p.admitted_past(self.tpot_slo_s)
                            and self.quiet_whole_fits(p, by_id[p.worker])])

        def relieved(plan: PlanEstimate, reason: str, sensitive: bool = False) -> PathDecision:
            # the split's plan misses its TTFT (the prefillers' queues): a plan that prefills
            # on a quiet decoder instead, when it is expected to put fewer requests past an SLO
            if plan.ttft_s > self.ttft_slo_s:
                relief = best(quiet_plans)
                if relief is not None and \
                        relief.expected_misses(*slo) < plan.expected_misses(*slo):
                    return PathDecision(relief, "split_relief", plan, sensitive=sensitive)
            return PathDecision(plan, reason, best_whole, sensitive=sensitive)

        sensitive = self.stall_sensitive(request, output_tokens, engines)
        if sensitive:
            # decoded where no prefill runs: a reserved decoder, or one that cannot prefill;
            # with neither, P/D would only move the answer to another engine that prefills (it
            # is planned as any other, and still counts toward the demand that reserves one)
            quiet = [p for p in pd if by_id[p.worker].reserved or not by_id[p.worker].prefill]
            if quiet or quiet_whole:
                return relieved(quiet_whole or best(quiet),  # type: ignore[arg-type]
                                "stall_sensitive", sensitive=True)
        # while the split keeps quiet decoders, the fleet runs as P/D pools: every request
        # takes a P/D plan onto a quiet decoder (or, short, is served whole there). A whole
        # plan elsewhere would decode on an engine that takes every prefill (stalled, and
        # adding to its queue) while the quiet decoder has room.
        split = [p for p in pd if by_id[p.worker].reserved]
        if split:
            return relieved(quiet_whole or best(split), "split",  # type: ignore[arg-type]
                            sensitive=sensitive)
        # a whole plan that meets the SLOs: the least prefill work (a cached prefix), then the
        # least loaded; cache affinity is kept only while the SLOs hold
        meeting = min((p for p in whole if p.meets(*slo)),
                      key=lambda p: (p.uncached_tokens, round(p.expected_misses(*slo), 2),
                                     p.badness(*slo), p.worker), default=None)
        if meeting is not None:
            return PathDecision(meeting, "whole_meets_slo", best_pd, sensitive=sensitive)
        meeting = best([p for p in pd if p.meets(*slo)])
        if meeting is not None:
            return PathDecision(meeting, self._why_not_whole(best_whole), best_whole,
                                sensitive=sensitive)
        chosen = best([best_whole, best_pd])
        assert chosen is not None
        return PathDecision(chosen, "best_effort",
                            best_pd if chosen is best_whole else best_whole, sensitive=sensitive)

    def decide_held(self, request: RouteRequest, output_tokens: int,
                    engines: Sequence[EngineLoad], whole: list[PlanEstimate],
                    pd: list[PlanEstimate]) -> PathDecision:
        """Every plan, sent now or held until the answers its prefill would stall have
        finished: the one that meets both SLOs and pushes no admitted answer past the TPOT (the
        most of the prompt cached, whole before P/D, then the earliest first token); else the
        fewest expected misses among those sent now and the held ones within the TTFT."""
        slo = (self.ttft_slo_s, self.tpot_slo_s)
        n, out = request.prompt_len, output_tokens
        plans = whole + pd
        sent_now = {p.worker: p for p in whole}
        for e in engines:
            if e.whole and not e.recently_failed:
                held = estimate_whole_deferred(self.costs, n, out, e, self.tpot_slo_s,
                                               sent_now.get(e.worker_id), self.material_s)
                if held is not None:
                    plans.append(held)
        by_id = {e.worker_id: e for e in engines}
        for p in pd:
            assert p.prefill_worker is not None
            held = estimate_pd_deferred(self.costs, n, out, by_id[p.prefill_worker],
                                        by_id[p.worker], self.tpot_slo_s, p, self.material_s)
            if held is not None:
                plans.append(held)
        ok = [p for p in plans if p.ttft_s <= self.ttft_slo_s and p.tpot_s <= self.tpot_slo_s
              and not p.admitted_past(self.tpot_slo_s)]
        chosen = min(ok, key=lambda p: (p.uncached_tokens, p.path != "whole", p.ttft_s,
                                        p.worker, p.prefill_worker or ""), default=None)
        if chosen is not None:
            return PathDecision(chosen, "held" if chosen.hold_s else
                                "whole_meets_slo" if chosen.path == "whole" else "pd_meets_slo")
        # no plan meets them: a held plan only within the TTFT (one held past it misses anyway,
        # and delays every request behind it)
        fallback = whole + pd + [p for p in plans if p.hold_s and p.ttft_s <= self.ttft_slo_s]
        best = min(fallback, key=lambda p: (round(p.expected_misses(*slo), 2),
                                              p.badness(*slo), p.worker, p.prefill_worker or ""))
        return PathDecision(best, "best_effort")

    def quiet_whole_fits(self, plan: PlanEstimate, engine: EngineLoad) -> bool:
        """Whether ``plan``'s prefill is short enough to run whole on the quiet decoder
        ``engine``: no longer than the P/D hop plus one token's TPOT slack of what it decodes.
        Sent P/D, such a prompt waits behind the prefillers' long prompts and then pays the hop
        (its decode's call, handshake and pull); whole, it stalls this decoder's answers once by
        at most that much (``decide`` takes it only when no answer is pushed past the TPOT,
        ``PlanEstimate.admitted_past``).
        Bounded by one token's slack alone, only prompts of under ~60 tokens qualified on the
        2-core box, and selective (threshold 512) kept the short ones off its prefiller."""
        slack = self.tpot_slo_s - self.costs.step_s(engine.running + 1)
        return self.costs.prefill_s(plan.uncached_tokens) <= self.costs.hop_s + slack

    def stall_sensitive(self, request: RouteRequest, output_tokens: int,
                        engines: Sequence[EngineLoad]) -> bool:
        """Its tail TPOT on a typical engine that prefills (this fleet's prefill rate spread
        over the engines that take prefills, landing while it waits for its own prefill and
        while it decodes) misses the SLO, while a decoder that prefills nothing would keep it:
        such requests are decoded where no prefill runs (the split's quiet decoders), whatever
        the momentary load of one engine says."""
        open_ = [e for e in engines if not e.reserved and (e.prefill or e.whole)]
        decoders = [e for e in engines if e.decode]
        if not open_ or len(decoders) + len(open_) < 2:
            return False
        out = max(output_tokens, 1)
        rate = sum(e.prefill_rate for e in engines) / len(open_)
        typical = EngineLoad("typical", running=round(sum(e.running for e in open_)
                                                      / len(open_)),
                             prefill_rate=rate, mean_prefill_s=_typical_prefill_s(engines))
        # a prefill sent to that engine while the request waits for its own runs after it,
        # between its decode steps (first come, first served): its wait is exposure too (its
        # own prefill: what the engine holding most of its prompt would compute)
        stall = decode_stall(self.costs, typical, out)
        uncached = request.prompt_len - max(e.cached_tokens for e in open_)
        wait = sum(e.queued_s for e in open_) / len(open_) + self.costs.prefill_s(uncached)
        exposed = replace(stall, landings_mean=stall.landings_mean + rate * wait)
        if exposed.tpot_s() <= self.tpot_slo_s:
            return False
        least = min((e.running for e in decoders), default=0)
        hop = self.costs.hop_s + request.prompt_len * self.costs.pull_s_per_token
        return self.costs.step_s(least + 1) + hop / token_intervals(out) <= self.tpot_slo_s

    def _why_not_whole(self, plan: PlanEstimate) -> str:
        if plan.ttft_s > self.ttft_slo_s:
            return "whole_misses_ttft"
        if plan.tpot_s > self.tpot_slo_s:
            return "whole_misses_tpot"
        return "whole_harms_admitted"

    # -- what happened --------------------------------------------------------------------------

    def dispatched(self, request: RouteRequest, plan: PlanEstimate, output_tokens: int,
                   now_s: float, *, sensitive: bool = False) -> None:
        """``plan`` was sent at ``now_s``: the prefilling engine's queue and share grow by its
        prefill, the decoding engine decodes it, both caches now hold the prompt; a
        ``sensitive`` decode (``PathDecision.sensitive``) adds to the quiet decoders' demand."""
        decay = self._decay(self._sensitive_at_s, now_s)
        self._all_requests = self._all_requests * decay + 1.0
        self._sensitive_tokens *= decay
        self._sensitive_requests *= decay
        self._sensitive_at_s = now_s
        if sensitive:
            self._sensitive_tokens += output_tokens
            self._sensitive_requests += 1.0
        prefiller = plan.prefill_worker or plan.worker
        seconds = self.costs.prefill_s(plan.uncached_tokens)
        engine = self._engines.setdefault(prefiller, _Engine())
        booking = engine.booked[request.request_id] = _Booking(
            seconds, now_s + plan.hold_s, released=not plan.hold_s)
        self._schedule(engine, now_s)
        starts_s, ends_s = booking.start_s, booking.end_s
        decay = self._decay(engine.share_at_s, now_s)
        engine.share_s = engine.share_s * decay + seconds
        engine.count = engine.count * decay + (1.0 if seconds > 0 else 0.0)
        engine.pushing = engine.pushing * decay + (
            1.0 if seconds > 0 and plan.admitted_past(self.tpot_slo_s) else 0.0)
        engine.square_s = engine.square_s * decay + seconds * seconds
        engine.share_at_s = now_s
        step = self.costs.step_s(len(engine.decoding))
        for admitted in engine.decoding.values():  # the prefill stalls what it decodes by then
            # (a held prefill waited for the ones it would stall: those ended by its start)
            if admitted[2] < ends_s and (not plan.hold_s or _ends_s(admitted, step) > starts_s):
                admitted[1] += seconds / token_intervals(admitted[0])
        decoder = self._engines.setdefault(plan.worker, _Engine())
        decoder.decoding[request.request_id] = [float(output_tokens), 0.0, ends_s]
        self._prefilling[request.request_id] = prefiller
        self._requests[request.request_id] = (plan.worker,)
        for worker in {prefiller, plan.worker}:
            cache = self._caches.get(worker)
            if cache is None:
                cache = self._caches[worker] = PrefixCacheModel(self.capacity_blocks)
            cache.insert(request.block_hashes)

    def prefilled(self, request_id: str, now_s: float) -> None:
        """``request_id``'s prefill ended at ``now_s`` (the router saw its prefill's answer or
        its first token): it starts decoding now, and its engine's next prefill starts now
        (at the earliest): an engine runs the prefills sent to it in order, so what was booked
        there after it ends as much earlier or later as it did, but a held one no earlier than
        it is sent. Without this the queue kept every error of the model until the engine
        emptied (on the box, TTFTs predicted 2.7x the observed in a burst)."""
        worker = self._prefilling.pop(request_id, None)
        admitted = self._decoding(request_id)
        if worker is None or admitted is None:
            return
        admitted[2] = now_s
        engine = self._engines.get(worker)
        if engine is not None and engine.booked.pop(request_id, None) is not None:
            engine.done_s = max(engine.done_s, now_s)
            self._schedule(engine, now_s)

    def released(self, request_id: str, now_s: float) -> None:
        """The held ``request_id`` was sent at ``now_s`` (the answers it waited for ended, or
        its wait's limit came): its prefill joins the engine's queue of sent prefills, behind
        those sent before it and ahead of the ones still held."""
        worker = self._prefilling.get(request_id)
        engine = self._engines.get(worker) if worker is not None else None
        booking = engine.booked.get(request_id) if engine is not None else None
        if engine is None or booking is None or booking.released:
            return
        del engine.booked[request_id]  # re-inserted last: sent after every one sent so far
        engine.booked[request_id] = replace(booking, release_s=now_s, released=True)
        self._schedule(engine, now_s)

    def _schedule(self, engine: _Engine, now_s: float) -> None:
        """Lay out ``engine``'s booked prefills at ``now_s``: the sent ones one after another
        in the order they were sent (the first from its last heard end), then the held ones by
        when they are expected to be sent (none before ``now_s``: still held). A request sent
        now therefore waits only for the prefills already sent, not for the slots of held ones
        (those go after it); each request's decode starts at its prefill's end. A sent prefill
        not heard to end by its predicted end is not assumed to run on: a non-streamed whole
        request is heard only when it ends."""
        t = engine.done_s
        held: list[tuple[str, _Booking]] = []
        for rid, booking in engine.booked.items():
            if not booking.released:
                held.append((rid, booking))
                continue
            booking.start_s = max(t, booking.release_s)
            t = booking.end_s = booking.start_s + booking.seconds
            self._starts_decoding(rid, t)
        engine.sent_until_s = t
        for rid, booking in sorted(held, key=lambda b: b[1].release_s):
            booking.start_s = max(t, booking.release_s, now_s)
            t = booking.end_s = booking.start_s + booking.seconds
            self._starts_decoding(rid, t)
        engine.busy_until_s = t

    def _starts_decoding(self, request_id: str, at_s: float) -> None:
        admitted = self._decoding(request_id)
        if admitted is not None:
            admitted[2] = at_s

    def _decoding(self, request_id: str) -> list[float] | None:
        """``request_id``'s entry in its decoding engine's ``_Engine.decoding`` (None: none)."""
        engines = self._requests.get(request_id, ())
        engine = self._engines.get(engines[0]) if engines else None
        return engine.decoding.get(request_id) if engine is not None else None

    def stall_added_s(self, request_id: str) -> float:
        """The stall per token the prefills dispatched onto ``request_id``'s engine added to
        its answer (0 when it is not known): what of its TPOT is not the engine's step."""
        admitted = self._decoding(request_id)
        return admitted[1] if admitted is not None else 0.0

    def learn(self, predicted_ttft_s: float, observed_ttft_s: float | None,
              base_tpot_s: float, observed_tpot_s: float | None,
              predicted_wait_s: float = 0.0,
              planned_scales: tuple[float, float] | None = None) -> None:
        """Move the cost scales toward what one served request showed (online calibration
        from the router's own measurements: a deployment's engines need no profile to start
        right; a profile, ``PathCosts.from_profile``, only starts them closer). The prefill
        scale learns only from a request whose predicted TTFT was mostly its own prefill
        (``predicted_wait_s``, the queue, hold and hop before it, under a quarter): a queued
        request's error is the queue's, which :meth:`prefilled` corrects (learned from every
        request, TTFT predictions on the box went from 2.7x too long in a burst to 14x too
        short in the ten seconds after it, as that learning would make them). The decode
        scale learns the step: ``base_tpot_s`` (``PlanEstimate.tpot_base_s``, no landing
        prefill) against the observed TPOT less the stall the router's own prefills added to
        it (:meth:`stall_added_s`), from :data:`MIN_LEARN_TPOT_S`. Against the predicted tail
        (a whole landing prefill that most answers never see), with TPOTs under 5 ms ignored,
        it fell to 0.3-0.5x on the box: the model's step was ~2.5 ms where 2-12-token answers
        took 8.6 ms (p50), and answers were predicted to end 2-3x too soon.

        ``planned_scales``: the (prefill, decode) scales the predictions were made with (None:
        the current ones). A request's observed/predicted ratio says what the scale should
        have been when it was planned, so the target is that scale times the ratio, not the
        current one: an answer ends seconds after its plan, while tens of others have moved
        the scale, and applied to the current scale every ratio counted the correction the
        others already made (on the box the decode scale swung between 0.39 and 2.76 within
        ten seconds of a 60 s run at 8 req/s)."""
        lo, hi = SCALE_LIMITS

        planned_prefill, planned_decode = planned_scales or (self.prefill_scale,
                                                             self.decode_scale)

        def step(scale: float, planned: float, predicted: float, observed: float | None,
                 least: float = MIN_LEARN_S) -> float:
            if observed is None or observed <= 0 or predicted < least or planned <= 0:
                return scale
            ratio = min(max(observed / predicted, 0.25), 4.0)  # one outlier moves it little
            target = min(max(planned * ratio, lo), hi)
            return min(max(math.exp((1 - LEARNING_RATE) * math.log(scale)
                                    + LEARNING_RATE * math.log(target)), lo), hi)

        if predicted_wait_s <= MAX_LEARN_WAIT * predicted_ttft_s:
            self.prefill_scale = step(self.prefill_scale, planned_prefill, predicted_ttft_s,
                                      observed_ttft_s)
        self.decode_scale = step(self.decode_scale, planned_decode, base_tpot_s,
                                 observed_tpot_s, MIN_LEARN_TPOT_S)
        self.costs = self.base_costs.scaled(self.prefill_scale, self.decode_scale)

    def finished(self, request_id: str) -> None:
        """``request_id`` ended (answered, failed or re-planned): its engines stop counting it."""
        prefiller = self._prefilling.pop(request_id, None)
        engine = self._engines.get(prefiller) if prefiller is not None else None
        if engine is not None:  # ended before its prefill was heard: it books nothing more
            engine.booked.pop(request_id, None)
        for worker in self._requests.pop(request_id, ()):
            engine = self._engines.get(worker)
            if engine is not None:
                engine.decoding.pop(request_id, None)

    def retain(self, worker_ids: Iterable[str]) -> None:
        """Forget engines not in ``worker_ids`` (they left the fleet)."""
        keep = set(worker_ids)
        for gone in set(self._engines) - keep:
            del self._engines[gone]
        for gone in set(self._caches) - keep:
            del self._caches[gone]
