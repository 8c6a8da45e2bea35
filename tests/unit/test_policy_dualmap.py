"""DualMap core: hashing, rings, cache model, SLO switch, hot prefixes, rebalancing."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.policy.base import Candidate, CandidatePool, Dispatched, Membership, RouteRequest
from router.policy.cache_model import PrefixCacheModel
from router.policy.dualmap import DualMapPolicy
from router.policy.hashing import block_hashes, hash_int
from router.policy.load_model import LoadModel
from router.policy.rebalance import QueuedRequest, plan_rebalance, total_predicted_ttft
from router.policy.registry import BASELINES, PEERS, PREFILL_POLICIES, create_prefill_policy
from router.policy.ring import DualRing, HashRing

NODES = [f"w{i}" for i in range(20)]
KEYS = [hash_int(k, 7) for k in range(4000)]


def test_block_hashes_chain_and_ignore_partial_block() -> None:
    toks = list(range(40))
    h = block_hashes(toks, 16)
    assert len(h) == 2
    assert block_hashes(toks[:32], 16) == h
    assert block_hashes([0, *toks[1:]], 16) == h
    changed = block_hashes([999, *toks[1:]], 16)
    assert changed[0] != h[0] and changed[1] != h[1]  # chained: a prefix change moves all
    assert block_hashes(toks[:15], 16) == ()


def test_ring_determinism_across_processes() -> None:
    code = ("import json; from router.policy.ring import DualRing; "
            "r = DualRing([f'w{i}' for i in range(20)]); "
            "print(json.dumps([r.pair(k) for k in range(200)]))")
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2")]
    here = DualRing(NODES)
    expected = [list(here.pair(k)) for k in range(200)]
    assert json.loads(outs[0]) == json.loads(outs[1]) == expected


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("change", ["remove", "add"])
def test_membership_change_moves_about_one_nth_of_keys(seed: int, change: str) -> None:
    before = HashRing(NODES, seed=seed)
    after = HashRing(NODES, seed=seed)
    if change == "remove":
        after.remove("w7")
        moved_node, n = "w7", len(NODES)
    else:
        after.add("w20")
        moved_node, n = "w20", len(NODES) + 1
    moved = [k for k in KEYS if before.lookup(k) != after.lookup(k)]
    # only keys owned by the changed instance move, and about 1/N of them
    owner = before if change == "remove" else after
    assert all(owner.lookup(k) == moved_node for k in moved)
    assert len(moved) / len(KEYS) <= 1.5 / n + 0.02


def test_incremental_membership_equals_fresh_ring() -> None:
    ring = HashRing(NODES[:10])
    for node in NODES[10:]:
        ring.add(node)
    ring.remove("w3")
    fresh = HashRing([n for n in NODES if n != "w3"])
    assert [ring.lookup(k) for k in KEYS[:500]] == [fresh.lookup(k) for k in KEYS[:500]]


@given(st.integers(min_value=0, max_value=2**64 - 1),
       st.sets(st.sampled_from(NODES), min_size=1, max_size=20))
@settings(max_examples=60)
def test_pair_is_distinct_and_allowed(key: int, allowed: set[str]) -> None:
    a, b = DualRing(NODES).pair(key, allowed)
    assert a in allowed
    if len(allowed) > 1:
        assert b in allowed and b != a
    else:
        assert b is None


def test_cache_model_lru_keeps_prefix() -> None:
    m = PrefixCacheModel(capacity_blocks=4)
    m.insert([1, 2, 3])
    assert m.match([1, 2, 3, 9]) == 3
    m.insert([1, 5, 6])  # 5 blocks > 4: the least recent (the old tail 3) goes
    assert m.match([1, 2, 3]) == 2 and m.match([1, 5, 6]) == 3


def _linear_match(m: PrefixCacheModel, hashes: tuple[int, ...]) -> int:
    n = 0
    while n < len(hashes) and hashes[n] in m:
        n += 1
    return n


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 12), st.integers(0, 3)),
                min_size=1, max_size=80),
       st.integers(3, 40))
def test_cache_model_binary_search_match_equals_linear_scan(
        ops: list[tuple[int, int, int]], capacity: int) -> None:
    # prompts share prefixes (6 system prompts, varied suffixes); after every insert and
    # eviction, the binary-search match must equal a block-by-block scan on every prompt seen
    m = PrefixCacheModel(capacity_blocks=capacity)
    seen: list[tuple[int, ...]] = []
    for system, length, suffix in ops:
        toks = [system] * 16 * min(length, 4) + [100 + suffix] * 16 * max(length - 4, 0)
        hashes = block_hashes(toks, 16)
        seen.append(hashes)
        m.insert(hashes)
        for h in seen:
            assert m.match(h) == _linear_match(m, h)
            assert m.match(h + (12345,)) == _linear_match(m, h + (12345,))


def _req(i: int, tokens: list[int]) -> RouteRequest:
    return RouteRequest(f"r{i}", "m", prompt_token_ids=tuple(tokens))


def test_slo_switch_triggers_exactly_above_threshold() -> None:
    policy = DualMapPolicy(ttft_slo_s=2.0, switch_fraction=0.5, per_token_s=1e-3)
    req = _req(0, list(range(160)))  # 160 tokens = 10 blocks
    cands = [Candidate("a"), Candidate("b")]
    a, b = policy.pair(req, cands)
    assert a is not None and b is not None
    policy.observe(Dispatched("r-1", a, "m", req))  # a now caches the whole prompt
    # on a: uncached 0, TTFT = pending x 1e-3; threshold 1.0 s; b: (0 + 160) x 1e-3 = 0.16 s
    for pending, expected in [(999, a), (1000, a), (1001, b)]:
        pool = [Candidate(a, pending_prefill_tokens=pending), Candidate(b)]
        decision = policy.decide(req, pool)
        assert decision is not None
        assert decision.affine == a
        assert decision.chosen == expected, pending
        assert decision.switched == (expected == b)
    # above the threshold but the other candidate would be even slower: stay
    pool = [Candidate(a, pending_prefill_tokens=1500), Candidate(b, pending_prefill_tokens=1400)]
    assert policy.decide(req, pool).chosen == a  # type: ignore[union-attr]


def _holder_setup(**config: object) -> tuple[DualMapPolicy, RouteRequest, str, list[str]]:
    """A conversation's second turn whose first turn (and so its whole history) is cached on
    an instance outside the turn's ring pair: (policy, turn 2, that instance, all five)."""
    policy = DualMapPolicy(ttft_slo_s=2.0, per_token_s=1e-3, **config)  # type: ignore[arg-type]
    workers = [f"w{i}" for i in range(5)]
    policy.observe(Membership("m", tuple(workers)))
    turn1 = list(range(1000, 1800))  # 800 tokens = 50 blocks, key = the first 512
    turn2 = _req(2, turn1 + list(range(5000, 5160)))
    a, b = policy.pair(turn2, [Candidate(w) for w in workers])
    elsewhere = next(w for w in workers if w not in (a, b))
    policy.observe(Dispatched("r1", elsewhere, "m", _req(1, turn1)))
    return policy, turn2, elsewhere, workers


def test_the_instance_holding_the_longest_prefix_is_a_third_candidate() -> None:
    policy, turn2, holder, workers = _holder_setup()
    decision = policy.decide(turn2, [Candidate(w) for w in workers])
    assert decision is not None and decision.chosen == decision.holder == holder
    assert decision.cached_tokens[holder] == 800
    choice = policy.choose(turn2, [Candidate(w) for w in workers])
    assert choice is not None and choice.reason == "cache_holder"
    # control: without the options only the ring pair is considered
    policy, turn2, holder, workers = _holder_setup(cache_holder=False, least_loaded=False)
    decision = policy.decide(turn2, [Candidate(w) for w in workers])
    assert decision is not None and decision.chosen != holder and decision.holder is None


def test_a_loaded_holder_yields_to_the_slo_switch() -> None:
    policy, turn2, holder, workers = _holder_setup()
    # holder: uncached 160 behind 1,900 pending = 2.06 s > 2 s; the ring pair: 0.96 s
    pool = [Candidate(w, pending_prefill_tokens=1900 if w == holder else 0) for w in workers]
    decision = policy.decide(turn2, pool)
    assert decision is not None and decision.affine == holder and decision.switched
    assert decision.chosen != holder
    # 1,800 pending: 1.96 s, within the SLO: the holder keeps it
    pool = [Candidate(w, pending_prefill_tokens=1800 if w == holder else 0) for w in workers]
    assert policy.decide(turn2, pool).chosen == holder  # type: ignore[union-attr]


def test_no_switch_to_a_candidate_that_would_miss_the_slo_too() -> None:
    policy, turn2, holder, workers = _holder_setup()
    # holder: 160 uncached behind 2,100 pending = 2.26 s; every other instance: 960 uncached
    # behind 1,100 = 2.06 s, lower but past the 2 s SLO as well: recomputing saves nothing
    pool = [Candidate(w, pending_prefill_tokens=2100 if w == holder else 1100) for w in workers]
    decision = policy.decide(turn2, pool)
    assert decision is not None and decision.affine == holder
    assert decision.chosen == holder and not decision.switched
    # control: with the old rule it switches to the lower predicted TTFT
    policy, turn2, holder, workers = _holder_setup(switch_must_meet_slo=False)
    decision = policy.decide(turn2, pool)
    assert decision is not None and decision.switched and decision.chosen != holder


def test_a_holder_that_holds_less_than_the_pair_is_not_a_candidate() -> None:
    policy, turn2, holder, workers = _holder_setup()
    a, b = policy.pair(turn2, [Candidate(w) for w in workers])
    assert a is not None
    policy.observe(Dispatched("r0", a, "m", turn2))  # the pair's a now holds all of turn 2
    decision = policy.decide(turn2, [Candidate(w) for w in workers])
    assert decision is not None and decision.holder is None and decision.chosen == a


def test_of_equal_holders_the_less_loaded_one_is_the_candidate() -> None:
    policy, turn2, first, workers = _holder_setup()
    a, b = policy.pair(turn2, [Candidate(w) for w in workers])
    second = next(w for w in workers if w not in (a, b, first))
    policy.observe(Dispatched("r2", second, "m", _req(1, list(range(1000, 1800)))))
    for busy, idle in ((first, second), (second, first)):
        pool = [Candidate(w, pending_prefill_tokens=500 if w == busy else 0) for w in workers]
        decision = policy.decide(turn2, pool)
        assert decision is not None and decision.holder == decision.chosen == idle, busy


def test_a_prompt_nobody_holds_goes_to_the_least_loaded_instance() -> None:
    policy = DualMapPolicy(ttft_slo_s=2.0, per_token_s=1e-3)
    workers = [f"w{i}" for i in range(6)]
    policy.observe(Membership("m", tuple(workers)))
    req = _req(0, list(range(160)))
    a, b = policy.pair(req, [Candidate(w) for w in workers])
    idle = next(w for w in workers if w not in (a, b))
    pool = [Candidate(w, pending_prefill_tokens=0 if w == idle else 300) for w in workers]
    decision = policy.decide(req, pool)
    assert decision is not None and decision.chosen == decision.least == idle
    assert decision.predicted_ttft_s[idle] == pytest.approx(0.16)
    # control: without the option the choice stays on the ring pair
    policy = DualMapPolicy(ttft_slo_s=2.0, per_token_s=1e-3, least_loaded=False)
    policy.observe(Membership("m", tuple(workers)))
    decision = policy.decide(req, pool)
    assert decision is not None and decision.chosen in (a, b) and decision.least is None


def test_select_is_pure_and_matches_decide() -> None:
    policy = DualMapPolicy()
    cands = [Candidate(w) for w in NODES]
    req = _req(0, list(range(600)))
    first = policy.select(req, cands)
    assert all(policy.select(req, cands) == first for _ in range(3))
    assert first is not None and first.worker_id == policy.decide(req, cands).chosen  # type: ignore[union-attr]


def _hot_workload(policy_name: str, load_scale: int = 1) -> float:
    """50 % of requests share one 1024-token system prompt, the rest distinct prompts; each
    request's uncached tokens are charged to its instance, and an instance's pending tokens
    are its charged load / ``load_scale``. Returns max/mean charged load."""
    policy = create_prefill_policy(policy_name)
    workers = [f"w{i}" for i in range(16)]
    policy.observe(Membership("m", tuple(workers)))
    load: Counter[str] = Counter()
    system = list(range(1024))
    for i in range(1200):
        tokens = system + [100000 + i] * 64 * (1 + i % 7) if i % 2 == 0 else [200000 + i] * 1024
        req = _req(i, tokens)
        pool = CandidatePool([Candidate(w, pending_prefill_tokens=load[w] // load_scale)
                              for w in workers])
        choice = policy.select(req, pool)
        assert choice is not None
        cached = getattr(policy, "cached_prefix_tokens", lambda r, w: 0)(req, choice.worker_id)
        load[choice.worker_id] += len(tokens) - cached
        policy.observe(Dispatched(req.request_id, choice.worker_id, "m", req))
    mean = sum(load.values()) / len(workers)
    return max(load[w] for w in workers) / mean


def test_hot_prefix_spreads_under_dualmap_not_prefix_only() -> None:
    """A hot prefix stays on the instance that caches it while that instance's predicted TTFT
    is within the SLO, and spills to the ring candidates of its deepened keys past it.
    Control: with the load scaled down 50x no instance passes the SLO and the prefix stays
    where its cache is, as under prefix_only."""
    dual = _hot_workload("dualmap")
    prefix = _hot_workload("prefix_only")
    # measured: dualmap ~1.03, prefix_only ~3.2 (the hot prefix's instance does its 50 %)
    assert prefix > 2.5
    assert dual < 1.3 and dual < prefix / 2
    assert _hot_workload("dualmap", load_scale=50) > 2.5  # measured ~3.2


def test_hot_key_is_deepened() -> None:
    policy = DualMapPolicy()
    system = list(range(1024))
    hot = [_req(i, system + [5000 + i] * 32) for i in range(40)]
    key_before = policy.routing_key(hot[0])
    for r in hot:
        policy.observe(Dispatched(r.request_id, "w0", "m", r))
    keys = {policy.routing_key(r) for r in hot}
    assert key_before not in keys and len(keys) == len(hot)  # now per-request (deeper) keys


def _deepened_after_share(n_instances: int, share_every: int, requests: int) -> bool:
    """Whether a prefix sent with every ``share_every``-th request gets a deeper key."""
    policy = DualMapPolicy()
    policy.observe(Membership("m", tuple(f"w{i}" for i in range(n_instances))))
    system = list(range(1024))
    warm = _req(0, system + [7] * 32)
    key_before = policy.routing_key(warm)
    for i in range(requests):
        tokens = system + [5000 + i] * 32 if i % share_every == 0 else [900_000 + i] * 600
        r = _req(i, tokens)
        policy.observe(Dispatched(r.request_id, "w0", "m", r))
    return policy.routing_key(warm) != key_before


def test_hot_share_scales_with_pool_size() -> None:
    # a prefix with 2 % of the traffic is 4 instances' worth on 200 instances: hot there, not
    # on 16 (where hot = 6.12 %, the reference's ratio, ~ one instance's share)
    assert _deepened_after_share(200, 50, 4000)
    assert not _deepened_after_share(16, 50, 4000)
    assert _deepened_after_share(16, 10, 4000)  # 10 % is hot on 16


@given(
    queue=st.lists(st.tuples(st.integers(1, 4000), st.sampled_from(["t1", "t2", None]),
                             st.integers(1, 4000)), min_size=0, max_size=12),
    ahead=st.integers(0, 20_000),
    tails=st.tuples(st.integers(0, 30_000), st.integers(0, 30_000)),
    threshold=st.floats(0.1, 5.0),
)
@settings(max_examples=150)
def test_rebalancing_never_increases_total_predicted_ttft(
        queue: list[tuple[int, str | None, int]], ahead: int, tails: tuple[int, int],
        threshold: float) -> None:
    load = LoadModel(per_token_s=1e-4)
    items = [QueuedRequest(f"q{i}", t, alt, at) for i, (t, alt, at) in enumerate(queue)]
    tail = {"t1": tails[0], "t2": tails[1]}
    moves = plan_rebalance("s", items, ahead, tail, load, threshold)
    # the targets' existing queues are opaque work of ``tail`` tokens: model it as one item
    before_q = {"s": [q.tokens for q in items], "t1": [], "t2": []}
    ahead_map = {"s": ahead, **tail}
    before = total_predicted_ttft(before_q, ahead_map, load)
    moved = {m.request_id: m.target for m in moves}
    after_q: dict[str, list[int]] = {"s": [q.tokens for q in items if q.request_id not in moved],
                                     "t1": [], "t2": []}
    for m in moves:
        q = next(q for q in items if q.request_id == m.request_id)
        after_q[m.target].append(q.alternate_tokens)
    after = total_predicted_ttft(after_q, ahead_map, load)
    assert after <= before + 1e-9
    assert all(m.delta_s < 0 for m in moves)
    assert len(moved) == len(moves)  # each request moves at most once


def test_rebalance_hand_example() -> None:
    load = LoadModel(per_token_s=1e-3)
    items = [QueuedRequest("a", 1000, "t", 1000), QueuedRequest("b", 1000, "t", 200)]
    # source drains 3000 tokens = 3 s > 1 s; moving b: after 0.2, before 3.0 -> delta -2.8
    moves = plan_rebalance("s", items, 1000, {"t": 0}, load, threshold_s=1.0)
    assert [(m.request_id, m.target) for m in moves] == [("b", "t"), ("a", "t")]
    assert moves[0].delta_s == pytest.approx(0.2 - 3.0)
    # a: on s it would wait 1.0 + 1.0 = 2.0 s; on t behind b: (200 + 1000) x 1e-3 = 1.2 s
    assert moves[1].delta_s == pytest.approx(1.2 - 2.0)


def test_registry_has_all_names() -> None:
    assert set(PREFILL_POLICIES) == {"dualmap", *BASELINES, *PEERS}
    for name in PREFILL_POLICIES:
        assert create_prefill_policy(name).name == name
