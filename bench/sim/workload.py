"""Prefix-sharing model on top of a BurstGPT trace (BurstGPT has lengths, not prompts).

Parameters (:class:`WorkloadConfig`, defaults):
- ``system_prompts`` = 200 distinct system prompts with Zipf(``zipf_s`` = 1.1) popularity and
  lengths uniform in [``system_min_tokens`` = 512, ``system_max_tokens`` = 3072];
- ``hot_share`` = 0.0: if > 0, this share of requests uses system prompt 0 (the "one prefix
  carries half the traffic" scenario uses 0.5);
- conversation rows are turns of a session: the prompt = system prompt + every earlier turn
  (user tokens + response) + this turn's ``Request tokens``; a session restarts when the prompt
  would exceed ``max_prompt_tokens`` = 16,384. API rows are one-shot (system prompt + request);
- rows without ``Session ID`` continue a random recent session with probability
  ``continue_p`` = 0.7 (``open_sessions`` = 500 recent sessions);
- ``block_tokens`` = 16: the prompt is modelled as chained block hashes, one per full block.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from bench.trace import TraceRow
from router.policy.hashing import hash_ints


@dataclass(frozen=True)
class WorkloadConfig:
    """Prefix-sharing parameters."""

    system_prompts: int = 200
    zipf_s: float = 1.1
    system_min_tokens: int = 512
    system_max_tokens: int = 3072
    hot_share: float = 0.0
    max_prompt_tokens: int = 16_384
    continue_p: float = 0.7
    open_sessions: int = 500
    block_tokens: int = 16


@dataclass(frozen=True)
class SimRequest:
    """One simulated request: arrival (trace time), prompt as block hashes, lengths."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...]


class _Session:
    __slots__ = ("uid", "system", "tokens", "hashes")

    def __init__(self, uid: int, system: int, tokens: int, hashes: list[int]) -> None:
        self.uid = uid
        self.system = system
        self.tokens = tokens
        self.hashes = hashes


def build_requests(rows: Sequence[TraceRow], config: WorkloadConfig | None = None,
                   seed: int = 0) -> list[SimRequest]:
    """Turn trace rows into requests with shared prefixes (deterministic for a seed)."""
    return list(iter_requests(rows, config, seed))


def iter_requests(rows: Iterable[TraceRow], config: WorkloadConfig | None = None,
                  seed: int = 0) -> Iterator[SimRequest]:
    """Lazy :func:`build_requests` (for million-request runs)."""
    cfg = config or WorkloadConfig()
    rng = random.Random(seed)
    bt = cfg.block_tokens
    # cumulative once: random.choices would re-accumulate plain weights on every call
    cum_weights = list(itertools.accumulate(1.0 / (k + 1) ** cfg.zipf_s
                                            for k in range(cfg.system_prompts)))
    systems = range(cfg.system_prompts)
    sys_len = [rng.randint(cfg.system_min_tokens, cfg.system_max_tokens)
               for _ in range(cfg.system_prompts)]
    sys_hashes = [hash_ints(range(s * 1_000_003, s * 1_000_003 + sys_len[s] // bt), seed + 1)
                  for s in range(cfg.system_prompts)]
    by_id: dict[str, _Session] = {}
    recent: list[_Session] = []
    uid = 0
    t0: float | None = None

    def pick_system() -> int:
        if cfg.hot_share > 0 and rng.random() < cfg.hot_share:
            return 0
        return rng.choices(systems, cum_weights=cum_weights)[0]

    def new_session() -> _Session:
        nonlocal uid
        uid += 1
        s = pick_system()
        return _Session(uid, s, sys_len[s], list(sys_hashes[s]))

    for i, row in enumerate(rows):
        if t0 is None:
            t0 = row.timestamp_s
        sess: _Session | None = None
        if row.conversation:
            if row.session_id is not None:
                sess = by_id.get(row.session_id)
            elif recent and rng.random() < cfg.continue_p:
                sess = rng.choice(recent)
            if sess is None or sess.tokens + row.request_tokens > cfg.max_prompt_tokens:
                sess = new_session()
                if row.session_id is not None:
                    by_id[row.session_id] = sess
                else:
                    recent.append(sess)
                    if len(recent) > cfg.open_sessions:
                        recent.pop(0)
        else:
            sess = new_session()
        prompt = min(sess.tokens + row.request_tokens, cfg.max_prompt_tokens)
        # blocks past the session's known ones are new content of this session
        want = prompt // bt
        hashes = sess.hashes
        if len(hashes) < want:
            base = sess.uid * 65_537
            hashes.extend(hash_ints(range(base + len(hashes), base + want), seed + 2))
        yield SimRequest(i, row.timestamp_s - t0, prompt, row.response_tokens,
                         tuple(hashes[:want]))
        if row.conversation:
            sess.tokens = prompt + row.response_tokens
            # the response is part of the next turn's prefix; its blocks are new content
            want = min(sess.tokens, cfg.max_prompt_tokens) // bt
            if len(hashes) < want:
                base = sess.uid * 65_537
                hashes.extend(hash_ints(range(base + len(hashes), base + want), seed + 2))
