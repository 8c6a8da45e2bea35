"""The field's routers as pure placement policies: the peers DualMap is measured against.

One module per peer, each re-implemented from the peer's code as read in
``research/peer-routers.md`` (formula, defaults as shipped, how it knows load and cache):

- :mod:`.sglang_cache_aware`: SGLang / vllm-router ``cache_aware`` (balance check, approximate
  radix tree, min-load fallback);
- :mod:`.llmd_default`: llm-d's default EPP profile (queue 2, KV utilisation 2, approximate
  prefix cache 3, max-score picker), optional "stick or spill" prefix-affinity filter;
- :mod:`.dynamo_kv`: NVIDIA Dynamo's KV router cost (prefill blocks to compute + active blocks);
- :mod:`.aibrix_prefix`: AIBrix ``prefix-cache`` (prefix match % with a load-imbalance guard);
- :mod:`.preble_e2`: Preble's E2 runtime selector (exploit cached prefixes, else least load cost).

Like every policy they are pure: no I/O, clock or global randomness. Where a peer breaks ties or
explores at random, the draw is a seeded hash of ``(seed, request_id, worker_id)``
(:mod:`._common`): the same events give the same choices, and a request's draw does not depend on
how many requests came before it.
"""
