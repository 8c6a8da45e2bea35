"""Predicted TTFT and TPOT of one request on each path it could take (pure).

A path is ``whole`` (one engine prefills and decodes) or ``pd`` (engine p prefills and leases its
blocks, engine d pulls them and decodes). The model is the one DistServe's argument rests on: an
engine that prefills stalls the decode batch it runs, so a long prompt on a busy decoder costs
every sequence there time per token, while the P/D hop costs the request a second call and a pull.

Costs (:class:`PathCosts`, defaults are this repo's tiny model on one CPU core; ``pdserve bench
profile`` measures them for a deployment, :meth:`PathCosts.from_profile` reads that file):

    prefill_s(t)  = prefill_fixed_s + t x prefill_s_per_token        (t uncached prompt tokens)
                    + prefill_s_per_token_sq x ((c + t)² - c²)        (after c in context; the
                    square term is 0 unless the profile fitted one; the plans here pass c = 0)
    step_s(n)     = decode_step_s + (n - 1) x decode_step_s_per_seq  (one decode step, n seqs)

Per engine e (:class:`EngineLoad`): ``queued_s`` seconds of prefill already sent to it and not
done, ``running`` decoding sequences, the rate lambda_e and mean length P_e of the prefills it was
given lately, ``cached_tokens`` of this prompt it holds, and of what it decodes: the shortest
expected output L_a and the largest stall per token already added to one (S_a). With u = prompt -
cached, L the request's expected output tokens and G = max(L - 1, 1) the token gaps its TPOT
averages over ((last token - first) / (L - 1), as the benchmarks and vLLM measure it):

    TPOT on e    = step_s(running_e + 1) + k x P_e / G,   k = the q-quantile (q = 0.95, half
                   the attainment target's misses) of Poisson(lambda_e x G x step_s): how many
                   neighbours' prefills land on e while this request decodes there, in 19
                   requests of 20
    whole on w:  TTFT = queued_s(w) + prefill_s(u_w);  TPOT = TPOT on w
                 admitted on w: step_s(running_w + 1) + S_a + prefill_s(u_w) / G_a (the
                 last term only from ``material_s`` up: :func:`material`)
    pd p -> d:   TTFT = queued_s(p) + prefill_s(u_p) + hop_s + W,
                 W = max(queued_s(d) - queued_s(p) - prefill_s(u_p), 0): d's own prefill
                 still queued when p's ends (one forward at a time)
                 TPOT = TPOT on d + (hop_s + W + prompt x pull_s_per_token) / G
                 admitted on p: as whole's; on d: step_s(running_d + 1) + S_a

TPOT is judged per request (a request with 8 output tokens that catches one neighbour's 0.25 s
prefill misses a 25 ms SLO however rare prefills are on average), so the model predicts the
tail, not the mean stall. Each plan also carries the pieces of that tail (the TPOT with no
landing prefill, the mean number of landings, the TPOT each adds), from which
:meth:`PlanEstimate.tpot_miss_probability` prices the stall as a risk: the probability that
enough prefills land to push the request past a TPOT target. The quantile alone rounds a short
answer's risk away (with 0.1 landings expected the 0.9-quantile is 0, and one landing in ten
misses); :meth:`PlanEstimate.expected_misses` adds it to the plan's certain misses.

A plan meets its SLOs when TTFT <= the TTFT SLO, TPOT <= the TPOT SLO, and no engine it touches
that already decodes is pushed past the TPOT SLO (``harm_tpot_s``): that last term is where
goodput comes from, a request must not buy its own SLO with other requests'. Where the engines'
sequences are known one by one (``EngineLoad.admitted``), the expected misses count each one the
plan leaves past the TPOT target: a long prefill on a decoder under four short answers costs
four misses, not one (counted once, it outweighed one request's TTFT miss whenever one of the
four was already late). A prefill stalls only the sequences decoding by the time it ends: an
answer still waiting for its own prefill on another engine is not stalled by it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from router.errors import ConfigError

TAIL_QUANTILE = 0.95
"""The per-request TPOT is predicted at this quantile: a plan meets its TPOT when at most 1 in
20 of its requests would miss. Half of the goodput target's 1 in 10 (90 % attainment): a plan
that spent the whole budget on its own stall risk left none for TTFT misses and the model's
error (at 0.9, 12 % of the real box's whole plans that met it missed, prefill_heavy 2 req/s)."""


@dataclass(frozen=True)
class PathCosts:
    """Per-token and per-step costs of one engine kind."""

    prefill_s_per_token: float = 1.5e-4
    """Prefill seconds per uncached prompt token."""
    prefill_fixed_s: float = 0.01
    """Fixed seconds of one prefill (scheduling, the first step's launch)."""
    decode_step_s: float = 0.006
    """One decode step with one running sequence."""
    decode_step_s_per_seq: float = 0.0003
    """Added to a decode step by each further running sequence."""
    hop_s: float = 0.05
    """The P/D hop: the decode's call, its handshake and the pull's fixed cost, seen by the
    client as the gap between the prefill's token and the decode's first (measured on the
    2-core box under the switching goodput trace at 2 req/s: p50 51 ms, p90 85 ms)."""
    pull_s_per_token: float = 2e-6
    """Seconds to pull one prompt token's KV."""
    prefill_s_per_token_sq: float = 0.0
    """Attention's share of a prefill: computing tokens ``s`` to ``e`` of a prompt adds this
    x (e² - s²) seconds (the profile's ``per_token_sq_s``; 0: prefill is linear)."""

    def __post_init__(self) -> None:
        if self.prefill_s_per_token <= 0 or self.decode_step_s <= 0:
            raise ConfigError("prefill_s_per_token and decode_step_s must be > 0")
        if min(self.prefill_fixed_s, self.decode_step_s_per_seq, self.hop_s,
               self.pull_s_per_token, self.prefill_s_per_token_sq) < 0:
            raise ConfigError("path costs must be >= 0")

    def prefill_s(self, tokens: int, context: int = 0) -> float:
        """Seconds to prefill ``tokens`` uncached tokens after ``context`` tokens already in
        the sequence (its cached prefix; 0 when there are none)."""
        return self.prefill_fixed_s + self.compute_s(tokens, context) if tokens > 0 else 0.0

    def compute_s(self, tokens: int, context: int = 0) -> float:
        """The per-token part of :meth:`prefill_s`: ``tokens`` computed after ``context``
        (what one part of a batched prefill chunk adds)."""
        end = context + tokens
        return tokens * self.prefill_s_per_token \
            + self.prefill_s_per_token_sq * (end * end - context * context)

    def scaled(self, prefill: float, decode: float) -> PathCosts:
        """The same engine with every prefill time ``prefill`` x longer and every decode step
        ``decode`` x longer (the hop and the pull unchanged)."""
        return replace(self, prefill_s_per_token=self.prefill_s_per_token * prefill,
                       prefill_fixed_s=self.prefill_fixed_s * prefill,
                       prefill_s_per_token_sq=self.prefill_s_per_token_sq * prefill,
                       decode_step_s=self.decode_step_s * decode,
                       decode_step_s_per_seq=self.decode_step_s_per_seq * decode)

    def step_s(self, running: int) -> float:
        """Seconds of one decode step with ``running`` sequences (at least one)."""
        return self.decode_step_s + max(running - 1, 0) * self.decode_step_s_per_seq

    @classmethod
    def from_profile(cls, profile: Mapping[str, Any], **overrides: float) -> PathCosts:
        """Costs from ``pdserve bench profile``'s instance profile: the prefill line's
        ``fixed_s``/``per_token_s``, the decode points' ``step_s`` by ``batch_size`` (least squares
        line); missing parts keep their defaults; ``overrides`` win."""
        values: dict[str, float] = {}
        prefill = profile.get("prefill") or {}
        if prefill.get("per_token_s"):
            values["prefill_s_per_token"] = float(prefill["per_token_s"])
            values["prefill_fixed_s"] = float(prefill.get("fixed_s", 0.0))
            values["prefill_s_per_token_sq"] = float(prefill.get("per_token_sq_s", 0.0))
        points = [(int(p["batch_size"]), float(p["step_s"]))
                  for p in (profile.get("decode") or {}).get("points", [])
                  if "batch_size" in p and "step_s" in p]
        if points:
            base, per_seq = _line(points)
            values["decode_step_s"] = max(base + per_seq, 1e-4)  # step of one sequence
            values["decode_step_s_per_seq"] = max(per_seq, 0.0)
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | Path, **overrides: float) -> PathCosts:
        """:meth:`from_profile` of a profile JSON file; ConfigError when unreadable."""
        try:
            profile = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the instance profile {path}: {exc}") from None
        return cls.from_profile(profile, **overrides)


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``y = a + b x``; a flat line through the mean for one distinct x."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return my, 0.0
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


@dataclass(frozen=True)
class EngineLoad:
    """What the cost model knows of one engine at the moment of a decision."""

    worker_id: str
    whole: bool = True
    """Can serve a request whole (flex, aggregated and decode workers)."""
    prefill: bool = True
    """Can prefill and lease for another engine (flex and prefill workers)."""
    decode: bool = True
    """Can pull and decode (flex and decode workers)."""
    queued_s: float = 0.0
    """Seconds of prefill sent to it and not yet done: what a request sent now waits for."""
    booked_s: float = 0.0
    """Seconds until every prefill booked on it ends, the held requests' (not yet sent)
    included: what a request held now waits for at the least (below ``queued_s``: none
    held)."""
    running: int = 0
    """Sequences it decodes now."""
    prefill_rate: float = 0.0
    """Prefills per second it was given lately (lambda)."""
    mean_prefill_s: float = 0.0
    """Size-biased mean seconds of those prefills (P = sum P_i^2 / sum P_i): the length of the
    prefill a decode step finds running, which long prompts dominate."""
    cached_tokens: int = 0
    """Tokens of this request's prompt it holds in its prefix cache."""
    admitted_output_tokens: float = 0.0
    """Shortest expected output of the sequences it decodes (0: none or unknown)."""
    admitted_stall_s: float = 0.0
    """Largest prefill stall per token already added to one of the sequences it decodes."""
    admitted: tuple[tuple[float, float, float], ...] = ()
    """(expected output tokens, prefill stall per token already added, seconds until it starts
    decoding: 0 once it does) of each sequence it decodes or will decode once its prefill ends
    (empty: known only by the two worst cases above)."""
    admitted_ends_s: tuple[float, ...] = ()
    """Seconds until each sequence of ``admitted`` (same order) sends its last token."""
    admitted_ids: tuple[str, ...] = ()
    """The request id of each sequence of ``admitted`` (same order; empty: unknown)."""
    recently_failed: bool = False
    """In the router's failure cool-down: planned only when nothing else can serve."""
    reserved: bool = False
    """Kept quiet for stall-sensitive decodes (``router.policy.adaptive``'s split): it gets
    no prefill while another engine can take it."""


@dataclass(frozen=True)
class PlanEstimate:
    """One candidate path with its predictions."""

    path: str
    """``whole`` or ``pd``."""
    worker: str
    """The engine that decodes (``whole``: the only one)."""
    prefill_worker: str | None
    """``pd``: the engine that prefills; None for ``whole``."""
    ttft_s: float
    tpot_s: float
    harm_tpot_s: float
    """Predicted TPOT of the requests already decoding on the engines it touches (0: none)."""
    uncached_tokens: int
    """Prompt tokens the prefilling engine computes."""
    tpot_base_s: float = 0.0
    """Its TPOT if no neighbour's prefill lands on the decoding engine during its answer."""
    landings_mean: float = 0.0
    """Expected neighbours' prefills landing on the decoding engine during its answer."""
    landing_tpot_s: float = 0.0
    """TPOT each landing prefill adds (its mean length over the token gaps)."""
    admitted_tpots_s: tuple[float, ...] = ()
    """Predicted TPOT of each sequence the engines it touches decode or will decode
    (``EngineLoad.admitted``), after it (empty: only ``harm_tpot_s``, the worst, is known)."""
    hold_s: float = 0.0
    """Seconds the router is expected to hold the request before sending it (a held plan: its
    prefill waits for the answers it would push past the TPOT to finish)."""
    waits_for: tuple[str, ...] = ()
    """A held plan: the request ids of those answers (the router sends it once they end)."""

    def tpot_miss_probability(self, tpot_slo_s: float) -> float:
        """Probability that its own TPOT exceeds ``tpot_slo_s``: 1 when it does with no landing
        prefill, else the chance that enough land (Poisson)."""
        if self.tpot_base_s > tpot_slo_s:
            return 1.0
        if self.landings_mean <= 0 or self.landing_tpot_s <= 0:
            return 0.0
        hits = math.floor((tpot_slo_s - self.tpot_base_s) / self.landing_tpot_s) + 1
        return poisson_tail(self.landings_mean, hits)

    def admitted_past(self, tpot_slo_s: float) -> int:
        """Admitted requests past ``tpot_slo_s`` after this plan (1 for all of them when they
        are not known one by one)."""
        if self.admitted_tpots_s:
            return sum(1 for t in self.admitted_tpots_s if t > tpot_slo_s)
        return 1 if self.harm_tpot_s > tpot_slo_s else 0

    def expected_misses(self, ttft_slo_s: float, tpot_slo_s: float) -> float:
        """Requests this plan is expected to leave past an SLO: itself (certainly, when its
        TTFT misses; else with its TPOT's miss probability) and each admitted one past the TPOT
        after it (:meth:`admitted_past`)."""
        own = 1.0 if self.ttft_s > ttft_slo_s else self.tpot_miss_probability(tpot_slo_s)
        return own + self.admitted_past(tpot_slo_s)

    def meets(self, ttft_slo_s: float, tpot_slo_s: float) -> bool:
        """Within both SLOs without pushing admitted requests past the TPOT SLO."""
        return (self.ttft_s <= ttft_slo_s and self.tpot_s <= tpot_slo_s
                and self.harm_tpot_s <= tpot_slo_s)

    def badness(self, ttft_slo_s: float, tpot_slo_s: float) -> float:
        """The worst of the three predictions as a multiple of its SLO (< 1: meets)."""
        return max(self.ttft_s / ttft_slo_s, self.tpot_s / tpot_slo_s,
                   self.harm_tpot_s / tpot_slo_s)


def poisson_quantile(mean: float, q: float = TAIL_QUANTILE, limit: int = 64) -> int:
    """The smallest k with P(Poisson(mean) <= k) >= q."""
    if mean <= 0:
        return 0
    p = cdf = math.exp(-mean)
    k = 0
    while cdf < q and k < limit:
        k += 1
        p *= mean / k
        cdf += p
    return k


def poisson_tail(mean: float, k: int) -> float:
    """P(Poisson(mean) >= k)."""
    if k <= 0:
        return 1.0
    if mean <= 0:
        return 0.0
    p = cdf = math.exp(-mean)
    for i in range(1, k):
        p *= mean / i
        cdf += p
    return max(1.0 - cdf, 0.0)


@dataclass(frozen=True)
class Stall:
    """A decode's exposure to neighbours' prefills on its engine."""

    base_s: float
    """TPOT with no landing prefill (one decode step)."""
    landings_mean: float
    """Expected prefills landing during the answer."""
    per_landing_s: float
    """TPOT each landing adds."""

    def tpot_s(self) -> float:
        """TPOT at :data:`TAIL_QUANTILE` of the landings."""
        return self.base_s + poisson_quantile(self.landings_mean) * self.per_landing_s


def token_intervals(output_tokens: float) -> float:
    """The gaps a TPOT averages over, (last token - first) / (n - 1): at least one."""
    gaps = output_tokens - 1
    return 1 if gaps < 1 else gaps  # max(gaps, 1) without the builtin call (a hot path)


def decode_stall(costs: PathCosts, engine: EngineLoad, output_tokens: int, extra: int = 1
                 ) -> Stall:
    """The stall exposure of a request with ``output_tokens`` decoding on ``engine`` beside its
    ``running`` sequences (+ ``extra``): prefills land at the engine's rate over the steps
    after its first token, each adding its mean length spread over the token gaps."""
    gaps = token_intervals(output_tokens)
    step = costs.step_s(engine.running + extra)
    return Stall(step, engine.prefill_rate * gaps * step, engine.mean_prefill_s / gaps)


def decode_tpot(costs: PathCosts, engine: EngineLoad, output_tokens: int, extra: int = 1
                ) -> float:
    """Tail TPOT of a request with ``output_tokens`` decoding on ``engine`` beside its
    ``running`` sequences (+ ``extra``): the step, plus the neighbours' prefills that land on
    the engine during its decode, at :data:`TAIL_QUANTILE`."""
    return decode_stall(costs, engine, output_tokens, extra).tpot_s()


def material(stall_per_token_s: float, material_s: float) -> float:
    """A prefill's stall per token of one answer, or 0 when it is under ``material_s``: a stall
    the plans' TPOT margin absorbs alone is not counted against the answer (see
    ``AdaptivePaths.material_s``)."""
    return stall_per_token_s if stall_per_token_s >= material_s else 0.0


def _admitted_tpot(costs: PathCosts, engine: EngineLoad, stall_s: float,
                   material_s: float = 0.0) -> float:
    """TPOT of the worst-off sequence ``engine`` decodes after ``stall_s`` more prefill (0 when
    it decodes none; a stall per token under ``material_s`` is not counted)."""
    if not engine.running:
        return 0.0
    gaps = token_intervals(engine.admitted_output_tokens or 1.0)
    return costs.step_s(engine.running + 1) + engine.admitted_stall_s \
        + material(stall_s / gaps, material_s)


def _admitted_tpots(costs: PathCosts, engine: EngineLoad, stall_s: float,
                    material_s: float = 0.0) -> tuple[float, ...]:
    """TPOT of each sequence ``engine`` decodes (``EngineLoad.admitted``) after ``stall_s``
    more prefill, which runs after the engine's queue: a sequence whose own prefill ends after
    that is not stalled by it (nor one it stalls by under ``material_s`` per token)."""
    if not engine.running:
        return ()
    step = costs.step_s(engine.running + 1)
    if not stall_s:  # nothing to add (material() of a zero stall is 0.0)
        return tuple(step + stall + 0.0 for _, stall, _ in engine.admitted)
    ends_s = engine.queued_s + stall_s
    tpots = []
    for out, stall, starts_s in engine.admitted:  # the policy's hottest loop: one pass
        added = 0.0
        if starts_s < ends_s:
            per_token = stall_s / token_intervals(out or 1.0)
            if per_token >= material_s:
                added = per_token
        tpots.append(step + stall + added)
    return tuple(tpots)


def estimate_whole(costs: PathCosts, prompt_tokens: int, output_tokens: int,
                   engine: EngineLoad, material_s: float = 0.0) -> PlanEstimate:
    """The request served whole on ``engine`` (``material_s``: the least stall per token
    counted against an admitted answer)."""
    uncached = max(prompt_tokens - engine.cached_tokens, 0)
    prefill = costs.prefill_s(uncached)
    stall = decode_stall(costs, engine, output_tokens)
    return PlanEstimate("whole", engine.worker_id, None, engine.queued_s + prefill,
                        stall.tpot_s(), _admitted_tpot(costs, engine, prefill, material_s),
                        uncached, stall.base_s, stall.landings_mean, stall.per_landing_s,
                        _admitted_tpots(costs, engine, prefill, material_s))


def estimate_pd(costs: PathCosts, prompt_tokens: int, output_tokens: int,
                prefill: EngineLoad, decode: EngineLoad, material_s: float = 0.0
                ) -> PlanEstimate:
    """The request prefilled on ``prefill`` and decoded on ``decode``. The hop also waits for
    the prefill ``decode`` still has queued when this prefill ends (an engine runs one forward
    at a time: its pull and first step come after). On the 2-engine box flex-to-flex handoffs
    took 0.3-1.9 s against a 50 ms hop; this queue, the part the router sees, did not explain
    most of it (README, "Five changes to the decision")."""
    uncached = max(prompt_tokens - prefill.cached_tokens, 0)
    prefill_s = costs.prefill_s(uncached)
    ready_s = prefill.queued_s + prefill_s
    wait_s = costs.hop_s + max(decode.queued_s - ready_s, 0.0)
    hop = (wait_s + prompt_tokens * costs.pull_s_per_token) / token_intervals(output_tokens)
    stall = decode_stall(costs, decode, output_tokens)
    harm = max(_admitted_tpot(costs, prefill, prefill_s, material_s),
               _admitted_tpot(costs, decode, 0.0))
    return PlanEstimate("pd", decode.worker_id, prefill.worker_id, ready_s + wait_s,
                        stall.tpot_s() + hop, harm, uncached, stall.base_s + hop,
                        stall.landings_mean, stall.per_landing_s,
                        _admitted_tpots(costs, prefill, prefill_s, material_s)
                        + _admitted_tpots(costs, decode, 0.0))


def held_engine(engine: EngineLoad, admitted_tpots_s: tuple[float, ...], tpot_target_s: float
                ) -> tuple[EngineLoad, float, tuple[str, ...]] | None:
    """``engine`` as it will be once the sequences a prefill there would push past
    ``tpot_target_s`` (``admitted_tpots_s``: each one's TPOT after it, in ``admitted`` order)
    have sent their last token, the seconds until then and their ids (empty when
    ``admitted_ids`` is); None when it pushes none, when their ends are unknown (or infinite:
    one outlived its predicted end), or when the engine's own queue outlasts them anyway. Its
    prefill then starts once they have ended and the prefills held there before it have run
    (``booked_s``)."""
    ends = engine.admitted_ends_s
    if len(ends) != len(engine.admitted) or len(admitted_tpots_s) != len(ends):
        return None
    harmed = [i for i, t in enumerate(admitted_tpots_s) if t > tpot_target_s]
    hold = max((ends[i] for i in harmed), default=0.0)
    if hold <= engine.queued_s or math.isinf(hold):
        return None
    left = [i for i, end in enumerate(ends) if end > hold]
    ids = engine.admitted_ids
    known = len(ids) == len(ends)
    # held, it is sent behind the requests held there before it as well
    return replace(engine, queued_s=max(hold, engine.booked_s),
                   running=max(engine.running - (len(ends) - len(left)), 0),
                   admitted=tuple(engine.admitted[i] for i in left),
                   admitted_ends_s=tuple(ends[i] for i in left),
                   admitted_ids=tuple(ids[i] for i in left) if known else ()), \
        hold, tuple(ids[i] for i in harmed) if known else ()


def estimate_whole_deferred(costs: PathCosts, prompt_tokens: int, output_tokens: int,
                            engine: EngineLoad, tpot_target_s: float,
                            now: PlanEstimate | None = None, material_s: float = 0.0
                            ) -> PlanEstimate | None:
    """The request served whole on ``engine`` once the answers its prefill would push past
    ``tpot_target_s`` have finished: held by the router until then, so its prefill stalls none
    of them (:func:`held_engine`; None when there is nothing to wait for). ``now``: the same
    plan sent now, when the caller has it."""
    now = now or estimate_whole(costs, prompt_tokens, output_tokens, engine, material_s)
    held = held_engine(engine, now.admitted_tpots_s, tpot_target_s)
    if held is None:
        return None
    later, hold, ids = held
    return replace(estimate_whole(costs, prompt_tokens, output_tokens, later, material_s),
                   hold_s=hold, waits_for=ids)


def estimate_pd_deferred(costs: PathCosts, prompt_tokens: int, output_tokens: int,
                         prefill: EngineLoad, decode: EngineLoad, tpot_target_s: float,
                         now: PlanEstimate | None = None, material_s: float = 0.0
                         ) -> PlanEstimate | None:
    """:func:`estimate_pd` held until the answers its prefill would push past
    ``tpot_target_s`` on ``prefill`` have finished (None when there is nothing to wait for).
    ``now``: the same plan sent now, when the caller has it."""
    now = now or estimate_pd(costs, prompt_tokens, output_tokens, prefill, decode, material_s)
    held = held_engine(prefill, now.admitted_tpots_s[:len(prefill.admitted)], tpot_target_s)
    if held is None:
        return None
    later, hold, ids = held
    return replace(estimate_pd(costs, prompt_tokens, output_tokens, later, decode, material_s),
                   hold_s=hold, waits_for=ids)
