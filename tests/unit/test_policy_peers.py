"""The peer routers as placement policies: each decision pinned on hand-made states as the peer's
own code would decide it (research/peer-routers.md), plus what every policy must do."""

from __future__ import annotations

from collections import Counter

import pytest

from router.errors import ConfigError
from router.policy.base import (
    Candidate,
    Dispatched,
    Finished,
    Membership,
    PlacementPolicy,
    RouteRequest,
)
from router.policy.context import PolicyContext
from router.policy.peers.aibrix_prefix import AibrixPrefixPolicy, sample_std
from router.policy.peers.dynamo_kv import DynamoKvPolicy
from router.policy.peers.llmd_default import LlmdDefaultPolicy
from router.policy.peers.preble_e2 import PrebleE2Policy
from router.policy.peers.sglang_cache_aware import SGLangCacheAwarePolicy
from router.policy.registry import BASELINES, PEERS, PREFILL_POLICIES, create_prefill_policy

B = 16  # block tokens everywhere below


def req(rid: str, hashes: tuple[int, ...], tokens: int | None = None) -> RouteRequest:
    return RouteRequest(rid, "m", block_hashes=hashes,
                        num_prompt_tokens=len(hashes) * B if tokens is None else tokens)


def send(policy: PlacementPolicy, rid: str, worker: str, hashes: tuple[int, ...]) -> None:
    policy.observe(Dispatched(rid, worker, "m", req(rid, hashes)))


def pick(policy: PlacementPolicy, request: RouteRequest, cands: list[Candidate]) -> str:
    choice = policy.select(request, cands)
    assert choice is not None
    return choice.worker_id


def cands(**in_flight: int) -> list[Candidate]:
    return [Candidate(w, in_flight=n) for w, n in in_flight.items()]


# -- SGLang cache_aware ------------------------------------------------------------------------


def test_sglang_defaults_are_the_cli_ones() -> None:
    p = create_prefill_policy("sglang_cache_aware")
    assert isinstance(p, SGLangCacheAwarePolicy)
    assert (p.cache_threshold, p.balance_abs_threshold, p.balance_rel_threshold,
            p.tie_break) == (0.3, 64, 1.5, "index")
    assert p._budget_blocks == (1 << 26) // 4 // B  # 2^26 characters at 4 per token


def test_sglang_cache_branch_when_balanced() -> None:
    p = SGLangCacheAwarePolicy(block_tokens=B)
    send(p, "r0", "w1", (1, 2, 3, 4))
    # 3 of 4 blocks matched = 0.75 > 0.3; loads 0/5/0 are balanced (spread 5 <= 64)
    assert pick(p, req("r1", (1, 2, 3, 9)), cands(w0=0, w1=5, w2=0)) == "w1"
    # 2 of 4 = 0.5 > 0.3 still sticks; 1 of 4 = 0.25 does not: least loaded, lowest id
    assert pick(p, req("r2", (1, 2, 8, 9)), cands(w0=0, w1=5, w2=0)) == "w1"
    assert pick(p, req("r3", (1, 7, 8, 9)), cands(w0=0, w1=5, w2=0)) == "w0"


@pytest.mark.parametrize(("w0", "w1", "expected"), [
    (10, 100, "w0"),   # spread 90 > 64 and 100 > 15: imbalanced -> least loaded
    (10, 70, "w1"),    # spread 60 <= 64: balanced -> the tree's worker (negative control)
    (120, 185, "w0"),  # spread 65 > 64 and 185 > 180: imbalanced
    (130, 195, "w1"),  # spread 65 > 64 but 195 = 1.5 x 130: balanced
])
def test_sglang_balance_check_uses_both_thresholds(w0: int, w1: int, expected: str) -> None:
    p = SGLangCacheAwarePolicy(block_tokens=B)
    send(p, "r0", "w1", (1, 2, 3, 4))
    assert pick(p, req("r1", (1, 2, 3, 4)), cands(w0=w0, w1=w1)) == expected


def test_sglang_tenant_is_the_creator_of_the_deepest_node() -> None:
    p = SGLangCacheAwarePolicy(block_tokens=B)
    send(p, "r0", "w1", (1, 2, 3))
    send(p, "r1", "w2", (1, 2, 3, 4))
    pool = cands(w0=0, w1=9, w2=0)
    # block 3 was created by w1 (w2 only passed through it): w1, though w2 is idler
    assert pick(p, req("r2", (1, 2, 3, 5)), pool) == "w1"
    # block 4 was created by w2
    assert pick(p, req("r3", (1, 2, 3, 4, 6)), pool) == "w2"
    # the tenant is no candidate (already tried): least loaded
    assert pick(p, req("r4", (1, 2, 3, 5)), cands(w0=3, w2=1)) == "w2"


def test_sglang_min_load_tie_break() -> None:
    idle = cands(w0=0, w1=0, w2=0)
    by_index = SGLangCacheAwarePolicy(block_tokens=B)
    by_processed = SGLangCacheAwarePolicy(block_tokens=B, tie_break="processed")
    for policy in (by_index, by_processed):
        send(policy, "r0", "w0", (1,))
        send(policy, "r1", "w1", (2,))
    assert pick(by_index, req("r2", (9,)), idle) == "w0"
    assert pick(by_processed, req("r2", (9,)), idle) == "w2"


def test_sglang_evicts_each_tenants_lru_leaves_to_its_budget() -> None:
    p = SGLangCacheAwarePolicy(block_tokens=B, max_tree_tokens=2 * B)
    send(p, "r0", "w1", (1, 2, 3))
    assert p.cached_prefix_tokens(req("x", (1, 2, 3)), "w1") == 2 * B
    # 2 of 3 blocks = 0.67 > 0.3 still sticks
    assert pick(p, req("r1", (1, 2, 3)), cands(w0=0, w1=1)) == "w1"
    send(p, "r2", "w1", (5, 6))  # the older chain's blocks are now the LRU ones
    assert p.cached_prefix_tokens(req("x", (1, 2, 3)), "w1") == 0
    assert pick(p, req("r3", (1, 2, 3)), cands(w0=0, w1=1)) == "w0"


def test_sglang_forgets_departed_workers() -> None:
    p = SGLangCacheAwarePolicy(block_tokens=B)
    send(p, "r0", "w1", (1, 2))
    assert pick(p, req("r1", (1, 2)), cands(w0=0, w1=1, w2=0)) == "w1"
    p.observe(Membership("m", ("w0", "w2")))
    assert pick(p, req("r2", (1, 2)), cands(w0=0, w1=1, w2=0)) == "w0"  # least loaded now


# -- llm-d default profile ---------------------------------------------------------------------


def llmd(**kw: object) -> LlmdDefaultPolicy:
    return LlmdDefaultPolicy(block_tokens=B, prefix_block_tokens=B, **kw)  # type: ignore[arg-type]


def test_llmd_prefix_term_wins_when_load_is_close() -> None:
    p = llmd()
    send(p, "r0", "w1", (1, 2, 3, 4))
    pool = [Candidate("w0"), Candidate("w1", in_flight=2)]
    # S(w0) = 2*1 + 2*1 + 3*0 = 4; S(w1) = 2*0 + 2*1 + 3*1 = 5
    assert p.scores(req("r1", (1, 2, 3, 4)), pool) == {"w0": 4.0, "w1": 5.0}
    assert pick(p, req("r1", (1, 2, 3, 4)), pool) == "w1"


def test_llmd_load_terms_win_over_a_hot_but_busy_endpoint() -> None:
    p = llmd()
    send(p, "r0", "w1", (1, 2, 3, 4))
    pool = [Candidate("w0"), Candidate("w1", in_flight=2, kv_usage=0.6)]
    # S(w1) = 0 + 2*0.4 + 3 = 3.8 < S(w0) = 4
    assert pick(p, req("r1", (1, 2, 3, 4)), pool) == "w0"
    # half the prompt cached: S(w1) = 0 + 2 + 1.5 = 3.5 < 4 (negative control of the first test)
    assert pick(p, req("r2", (1, 2, 5, 6)), [Candidate("w0"),
                                              Candidate("w1", in_flight=2)]) == "w0"


def test_llmd_queue_is_requests_not_running() -> None:
    p = llmd()
    pool = [Candidate("w0", in_flight=4, running=4), Candidate("w1", in_flight=1)]
    assert p.scores(req("r", (1,)), pool) == {"w0": 4.0, "w1": 2.0}


def test_llmd_hashes_blocks_of_64_tokens() -> None:
    p = LlmdDefaultPolicy(block_tokens=B)
    send(p, "r0", "w1", tuple(range(1, 9)))  # llm-d blocks: (4, 8)
    request = req("r1", (1, 2, 3, 4, 9, 10, 11, 12))  # llm-d blocks: (4, 12)
    assert p.prefix_scores(request, [Candidate("w1")]) == {"w1": 0.5}
    assert p.cached_prefix_tokens(request, "w1") == 64


@pytest.mark.parametrize(("pending", "expected"), [
    (100_000, "w1"),  # 6,278 ms slower than the cold one < 18,000 ms: stick
    (400_000, "w0"),  # 25,113 ms > 18,000 ms: spill to every endpoint, scores decide
])
def test_llmd_stick_or_spill(pending: int, expected: str) -> None:
    p = llmd(affinity_filter=True)
    send(p, "r0", "w1", (1, 2, 3, 4))
    pool = [Candidate("w0"),
            Candidate("w1", in_flight=10, kv_usage=0.9, pending_prefill_tokens=pending)]
    # unfiltered, the scores prefer w0: S(w1) = 0 + 0.2 + 3 < S(w0) = 4
    assert pick(llmd_with(p), req("r1", (1, 2, 3, 4)), pool) == "w0"
    assert pick(p, req("r1", (1, 2, 3, 4)), pool) == expected


def llmd_with(filtered: LlmdDefaultPolicy) -> LlmdDefaultPolicy:
    """The same cache state without the filter."""
    plain = llmd()
    plain._caches = filtered._caches
    return plain


def test_llmd_ties_are_a_seeded_shuffle() -> None:
    pool = [Candidate("w0"), Candidate("w1"), Candidate("w2")]
    picks = [pick(llmd(), req(f"r{i}", (i,)), pool) for i in range(60)]
    assert picks == [pick(llmd(), req(f"r{i}", (i,)), pool) for i in range(60)]
    assert set(picks) == {"w0", "w1", "w2"}
    assert picks != [pick(llmd(seed=1), req(f"r{i}", (i,)), pool) for i in range(60)]


# -- Dynamo KV router --------------------------------------------------------------------------


def test_dynamo_cost_credits_the_cached_blocks() -> None:
    p = DynamoKvPolicy(block_tokens=B)
    send(p, "r0", "w1", (1, 2, 3, 4))
    pool = [Candidate("w0"), Candidate("w1", pending_prefill_tokens=32)]
    # w0: (0 + 64) / 16 = 4; w1: (32 + 64 - 64) / 16 = 2
    assert p.costs(req("r1", (1, 2, 3, 4)), pool) == {"w0": 4.0, "w1": 2.0}
    assert pick(p, req("r1", (1, 2, 3, 4)), pool) == "w1"
    assert p.cached_prefix_tokens(req("r1", (1, 2, 3, 4)), "w1") == 64


def test_dynamo_queued_prefill_outweighs_the_cache() -> None:
    p = DynamoKvPolicy(block_tokens=B)
    send(p, "r0", "w1", (1, 2, 3, 4))
    pool = [Candidate("w0"), Candidate("w1", pending_prefill_tokens=80)]
    assert p.costs(req("r1", (1, 2, 3, 4)), pool)["w1"] == 5.0  # > 4
    assert pick(p, req("r1", (1, 2, 3, 4)), pool) == "w0"


def test_dynamo_exact_ties_are_seeded_and_temperature_samples() -> None:
    p = DynamoKvPolicy(block_tokens=B)
    tied = [Candidate("w0"), Candidate("w1")]
    picks = [pick(p, req(f"r{i}", (i,)), tied) for i in range(40)]
    assert set(picks) == {"w0", "w1"}
    assert picks == [pick(DynamoKvPolicy(block_tokens=B), req(f"r{i}", (i,)), tied)
                     for i in range(40)]
    warm = DynamoKvPolicy(block_tokens=B, router_temperature=1.0, seed=3)
    send(warm, "r0", "w1", (1, 2, 3, 4))
    pool = [Candidate("w0"), Candidate("w1", pending_prefill_tokens=32)]
    # costs 4 and 2: p(w1) = 1 / (1 + e^-1) = 0.731
    share = Counter(pick(warm, req(f"q{i}", (1, 2, 3, 4)), pool) for i in range(600))
    assert 0.66 < share["w1"] / 600 < 0.80


def test_dynamo_overlap_credit_decay() -> None:
    p = DynamoKvPolicy(block_tokens=B, overlap_score_credit_decay=1.0)
    send(p, "r0", "w1", (1, 2, 3, 4))
    pool = [Candidate("w0"), Candidate("w1", pending_prefill_tokens=64)]
    # decay = 1 / (1 + 1 x (64/16) / 4) = 0.5: (64 + 64) / 16 - 0.5 x 4 = 6
    assert p.costs(req("r1", (1, 2, 3, 4)), pool) == {"w0": 4.0, "w1": 6.0}


def test_dynamo_active_blocks_term() -> None:
    p = DynamoKvPolicy(block_tokens=B, track_active_blocks=True)
    send(p, "r0", "w1", (1, 2, 3, 4))
    pool = [Candidate("w0"), Candidate("w1")]
    # w0: 4 + 4 new blocks = 8; w1: 4 + (4 live + 4 new) = 12
    assert p.costs(req("r1", (5, 6, 7, 8)), pool) == {"w0": 8.0, "w1": 12.0}
    # 40 tokens: 2.5 blocks to compute, 2 full blocks + a partial one (always new)
    assert p.costs(req("r2", (5, 6), tokens=40), pool) == {"w0": 5.5, "w1": 9.5}
    # the cached, live prompt costs nothing new on w1: 0 + 4 = 4
    assert p.costs(req("r3", (1, 2, 3, 4)), pool) == {"w0": 8.0, "w1": 4.0}
    p.observe(Finished("r0", "w1", "m"))
    assert p.costs(req("r1", (5, 6, 7, 8)), pool) == {"w0": 8.0, "w1": 8.0}


# -- AIBrix prefix-cache -----------------------------------------------------------------------


def aibrix(**kw: object) -> AibrixPrefixPolicy:
    return AibrixPrefixPolicy(block_tokens=B, prefix_block_tokens=B, **kw)  # type: ignore[arg-type]


def test_aibrix_sample_std() -> None:
    assert sample_std([0.0, 3.0, 0.0]) == pytest.approx(3 ** 0.5)
    assert sample_std([5.0]) == 0.0


def test_aibrix_best_match_within_the_load_bound() -> None:
    p = aibrix()
    send(p, "r0", "w1", (1, 2, 3, 4))
    # mean 1, std sqrt(3): bound 4.46 >= 3
    assert pick(p, req("r1", (1, 2, 3, 4)), cands(w0=0, w1=3, w2=0)) == "w1"
    # the higher match percentage wins over lower load
    send(p, "r2", "w0", (1, 2))
    assert p.match("m", (1, 2, 3, 4), ["w0", "w1", "w2"]) == {"w0": 50, "w1": 100}
    assert pick(p, req("r3", (1, 2, 3, 4)), cands(w0=0, w1=2, w2=0)) == "w1"


def test_aibrix_skips_a_matched_pod_above_mean_plus_two_std() -> None:
    p = aibrix()
    send(p, "r0", "w1", (1, 2, 3, 4))
    pool = [Candidate(f"w{i}", in_flight=10 if i == 1 else 0) for i in range(16)]
    # mean 0.625, std 2.5: bound 5.625 < 10 -> least-request over all (seeded among the idle)
    choice = pick(p, req("r1", (1, 2, 3, 4)), pool)
    assert choice != "w1"


@pytest.mark.parametrize(("w1", "expected"), [
    (20, "w0"),  # spread 20 > 16: only the least loaded are matched; w1 is not among them
    (15, "w1"),  # spread 15 <= 16, bound 6.67 + 2 x 7.64 >= 15: the match wins
])
def test_aibrix_imbalance_gate(w1: int, expected: str) -> None:
    p = aibrix()
    send(p, "r0", "w1", (1, 2, 3, 4))
    assert pick(p, req("r1", (1, 2, 3, 4)), cands(w0=0, w1=w1, w2=5)) == expected


def test_aibrix_global_lru_evicts_a_prompts_first_block_first() -> None:
    p = aibrix(block_number=3)
    send(p, "r0", "w1", (1, 2, 3, 4))
    assert p.match("m", (1, 2, 3, 4), ["w1"]) == {}  # block 1 was the least recent
    assert p.match("m", (2, 3, 4), ["w1"]) == {"w1": 100}


def test_aibrix_blocks_are_128_characters() -> None:
    p = AibrixPrefixPolicy(block_tokens=B)
    assert p.factor == 2
    send(p, "r0", "w1", (1, 2, 3, 4))  # AIBrix blocks: (2, 4)
    assert p.prefix_hashes(req("x", (1, 2, 3, 9))) == (2, 9)
    assert p.match("m", (2, 9), ["w1"]) == {"w1": 50}
    assert p.cached_prefix_tokens(req("x", (1, 2, 3, 9)), "w1") == 32


# -- Preble E2 ---------------------------------------------------------------------------------


def preble(**kw: object) -> PrebleE2Policy:
    return PrebleE2Policy(block_tokens=B, per_token_s=1e-4, **kw)  # type: ignore[arg-type]


X = tuple(range(1, 9))  # an 8-block prompt


def test_preble_cost_formula() -> None:
    p = preble()
    send(p, "r0", "w1", X)
    state = p.state("m")
    assert state is not None
    # one request through node X: miss 1 x count 1 x (128 x 1e-4 s) / 1 GPU + 1 live x 45 x 0.15
    assert state.totals["w1"] == pytest.approx(0.0128 + 6.75)
    p.observe(Finished("r0", "w1", "m"))
    assert state.totals["w1"] == pytest.approx(0.0128)


def test_preble_exploits_a_long_cached_prefix_and_explores_otherwise() -> None:
    p = preble()
    send(p, "r0", "w1", X)
    pool = [Candidate("w0"), Candidate("w1")]
    # 1 new block after 8 cached: exploit the GPUs X is allocated to, though w1 costs more
    assert pick(p, req("r1", (*X, 9)), pool) == "w1"
    # 8 new blocks after 2 cached: explore, the lowest load cost
    assert pick(p, req("r2", (1, 2, *range(20, 28))), pool) == "w0"
    # the very same prompt: its leaf is X itself, 8 tokens of its own > 0 before: explore
    assert pick(p, req("r3", X), pool) == "w0"


def test_preble_exploit_takes_the_cheapest_allocated_gpu() -> None:
    p = preble()
    send(p, "r0", "w1", X)
    send(p, "r1", "w0", X)  # X is now allocated to w1 and w0
    pool = [Candidate("w0"), Candidate("w1"), Candidate("w2")]
    p.observe(Finished("r0", "w1", "m"))
    assert pick(p, req("r2", (*X, 9)), pool) == "w1"  # w2 (idle) is not allocated
    p.observe(Dispatched("r0", "w1", "m", req("r0", X)))
    p.observe(Finished("r1", "w0", "m"))
    assert pick(p, req("r2", (*X, 9)), pool) == "w0"


def test_preble_split_moves_the_window_entry_to_the_upper_node() -> None:
    p = preble()
    send(p, "r0", "w1", X)
    send(p, "r1", "w0", (1, 2, 3, 4, *range(31, 39)))  # splits X after 4 blocks
    state = p.state("m")
    assert state is not None
    # upper (1-4): X's entry (miss 1, 64 tokens), allocated to w1 and w0, one live each:
    #   0.0064 / 2 + 6.75 on each; lower (5-8) is small (4 <= 4), no entry;
    # the new leaf (8 blocks after 4): miss 1 - 64/192, 128 tokens, on w0: 0.0128 x 2/3 + 6.75
    assert state.totals["w1"] == pytest.approx(0.0032 + 6.75)
    assert state.totals["w0"] == pytest.approx(0.0032 + 6.75 + 0.0128 * 2 / 3 + 6.75)
    # a follow-up of the upper part exploits it: w1 and w0 are allocated, w1 is cheaper
    pool = [Candidate("w0"), Candidate("w1"), Candidate("w2")]
    assert pick(p, req("r2", (1, 2, 3, 4, 99)), pool) == "w1"


def test_preble_window_resets_allocations() -> None:
    pool = [Candidate("w0"), Candidate("w1")]
    for window, expected in ((10, "w0"), (1, "w1")):
        p = preble(window_requests=window)
        send(p, "r0", "w0", X)
        send(p, "r1", "w0", (50, 51, 52))  # with a 1-request window, X leaves it
        assert pick(p, req("r2", (*X, 9)), pool) == expected


def test_preble_rebalancer_moves_a_cheap_node_to_the_idle_gpu() -> None:
    pool = [Candidate("w0"), Candidate("w1")]
    picks = {}
    for rebalance in (False, True):
        p = preble(rebalance=rebalance, rebalance_after=0)
        p.observe(Membership("m", ("w0", "w1")))
        y = (11, 12, 13, 14)
        for i, prompt in enumerate((X, X, y, y)):
            send(p, f"r{i}", "w0", prompt)
        picks[rebalance] = pick(p, req("q", (*y, 15)), pool)
    # X and Y were each placed twice on w0; Y, the cheaper node (shorter), moves to w1, after
    # which w0's cost (X) < 1.5 x w1's (Y); a follow-up of Y exploits its new allocation
    assert picks == {False: "w0", True: "w1"}


# -- every peer --------------------------------------------------------------------------------


def test_peers_are_registered_apart_from_the_baselines() -> None:
    assert PEERS == ("sglang_cache_aware", "llmd_default", "dynamo_kv", "aibrix_prefix",
                     "preble_e2")
    assert set(PEERS) <= set(PREFILL_POLICIES)
    assert not set(PEERS) & set(BASELINES)


@pytest.mark.parametrize("name", PEERS)
def test_peer_contract(name: str) -> None:
    policy = create_prefill_policy(name)
    assert policy.name == name and isinstance(policy, PlacementPolicy)
    with pytest.raises(ConfigError, match="no parameter bogus"):
        create_prefill_policy(name, bogus=1)
    assert policy.select(req("r", (1, 2)), []) is None
    failed = [Candidate("a", recently_failed=True),
              Candidate("b", in_flight=50, pending_prefill_tokens=5000)]
    assert pick(policy, req("r", (1, 2)), failed) == "b"
    send(policy, "r0", "a", (1, 2))  # even where the prompt is cached
    assert pick(policy, req("r1", (1, 2)), failed) == "b"
    assert pick(policy, req("r2", (1, 2)), [failed[0]]) == "a"  # all failed: still answers


def _replay(name: str) -> list[str]:
    """A small trace: 6 prefix families over 4 workers, loads from the policy's own picks."""
    policy = create_prefill_policy(name, PolicyContext(block_tokens=B))
    policy.observe(Membership("m", ("w0", "w1", "w2", "w3")))
    live: dict[str, tuple[str, int]] = {}
    picks = []
    for i in range(80):
        family = (i * 7) % 6
        hashes = (1000 + family, 2000 + family, *(10_000 * i + k for k in range(i % 5)))
        request = req(f"r{i}", hashes)
        load = Counter(w for w, _ in live.values())
        pending: Counter[str] = Counter()
        for w, tokens in live.values():
            pending[w] += tokens
        pool = [Candidate(f"w{k}", in_flight=load[f"w{k}"],
                          pending_prefill_tokens=pending[f"w{k}"]) for k in range(4)]
        worker = pick(policy, request, pool)
        picks.append(worker)
        policy.observe(Dispatched(request.request_id, worker, "m", request))
        live[request.request_id] = (worker, request.prompt_len)
        if i % 3 == 2:  # finish the oldest
            rid = next(iter(live))
            policy.observe(Finished(rid, live.pop(rid)[0], "m"))
    return picks


@pytest.mark.parametrize("name", PEERS)
def test_peer_is_deterministic(name: str) -> None:
    first = _replay(name)
    assert first == _replay(name)
    assert len(set(first)) > 1  # and it is not a constant


def test_context_cache_geometry_reaches_the_peers() -> None:
    ctx = PolicyContext(block_tokens=32, cache_capacity_blocks=1000, per_token_s=3e-4)
    dynamo = create_prefill_policy("dynamo_kv", ctx)
    assert dynamo.block_tokens == 32  # type: ignore[attr-defined]
    assert dynamo.cache.capacity_blocks == 1000  # type: ignore[attr-defined]
    assert create_prefill_policy("llmd_default", ctx).factor == 2  # type: ignore[attr-defined]
    assert create_prefill_policy("aibrix_prefix", ctx).factor == 1  # type: ignore[attr-defined]
    assert create_prefill_policy("preble_e2", ctx).per_token_s == 3e-4  # type: ignore[attr-defined]
