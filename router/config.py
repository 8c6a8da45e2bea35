"""Typed router settings; env vars and CLI flags are read only in :func:`load`."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from router import settings as shared
from router.errors import ConfigError
from router.settings import LOG_LEVELS, default

PATH_POLICIES = ("auto", "adaptive", "static", "whole", "pd")
"""Values of ``--path-policy`` (see ``RouterSettings.path_policy``)."""

ENV_PREFIX = "PDSERVE_ROUTER_"
__all__ = ["LOG_LEVELS", "RouterSettings", "load", "package_version"]


@dataclass(frozen=True)
class RouterSettings:
    """Everything the router process needs; defaults work on a laptop with no GPU."""

    host: str = "127.0.0.1"
    """Interface uvicorn binds."""
    port: int = 8000
    """TCP port of the OpenAI API."""
    listen_fd: int = -1
    """An inherited listening socket to serve on instead of binding ``host:port`` (-1: bind).
    ``pdserve up`` keeps the socket across router restarts, so connections that arrive while
    the router restarts wait in its backlog instead of being refused."""
    redis_url: str = default("redis_url")
    """Redis holding the worker registry."""
    redis_prefix: str = "pdserve"
    """Key prefix of the registry (``{prefix}:worker:{id}``, ``{prefix}:events``)."""
    policy: str = default("policy")
    """Prefill placement policy, a name in ``router.policy.registry.PREFILL_POLICIES``."""
    ttft_slo_s: float = default("ttft_slo_s")
    """TTFT SLO the prefill policy aims for (DualMap leaves cache affinity for load past it);
    the value and its reason: ``router.settings``."""
    prefill_s_per_token: float = default("prefill_s_per_token")
    """Calibrated prefill seconds per uncached prompt token (DualMap's TTFT prediction)."""
    tpot_slo_s: float = default("tpot_slo_s")
    """TPOT SLO the adaptive path decision plans for (``router.policy.adaptive``)."""
    decode_policy: str = default("decode_policy")
    """Decode placement policy, a name in ``router.policy.registry.DECODE_POLICIES``."""
    log_level: str = default("log_level")
    """Root log level."""
    refresh_interval_s: float = 1.0
    """How often the membership view is re-read from Redis."""
    connect_timeout_s: float = 5.0
    """TCP connect timeout of every upstream call."""
    prefill_timeout_s: float = 120.0
    """Read timeout of the prefill call (the whole prefill runs before vLLM answers)."""
    decode_timeout_s: float = 300.0
    """Read timeout of the decode call: the longest silence allowed between two chunks."""
    prefill_retries: int = 2
    """Extra attempts on other prefill workers after a connect error, timeout or 5xx."""
    decode_retries: int = 2
    """Extra attempts on other decode workers, only while no byte was relayed to the client."""
    migration_limit: int = 3
    """How many times one client stream may move to another worker after its output started
    (its worker died, reset, sent an error event or stalled); 0 = never (the stream ends with
    an error event, as before)."""
    stall_timeout_s: float = 3.0
    """A stream whose worker sent output and then nothing for this long (or 25 times its
    recent median gap, if longer) moves to another worker, and a request waiting on a worker
    whose load probes went unanswered this long goes elsewhere; 0 = only the timeouts."""
    redispatch_interval_s: float = 1.0
    """How often requests still queued in a worker's engine are checked for a worker of their
    pool that would start them sooner (one that joined or went idle), and moved there
    (``router.api.redispatch``); 0 = never."""
    warm_tokens: int = 16384
    """Prompt tokens sent to warm the prefix cache of a prefill, aggregated or flex worker
    that joins: the recent prompts placement would now send it that a peer caches, as
    one-token requests (``router.api.warm``); 0 = off."""
    no_worker_wait_s: float = 5.0
    """An admitted request that finds its pool empty (membership changing: an evicted or
    restarting worker) waits this long for a worker before failing with 503."""
    failure_cooldown_s: float = 5.0
    """A worker that just failed is tried last during this many seconds."""
    max_upstream_connections: int = 1000
    """Connection pool size of the shared upstream HTTP client."""
    load_poll_interval_s: float = 1.0
    """How often every worker's ``/metrics`` is read for its own load (running and waiting
    requests, KV usage) to feed placement; 0 turns it off (router accounting only)."""

    role_fallback: bool = True
    """When a P/D fleet's prefill or decode pool is empty, or every worker of it failed, the
    other pool's engines serve whole requests and take moved streams (any vLLM engine can);
    off: 503, and a stream whose pool has nobody left ends with an error event."""
    release_unspent_kv: bool = True
    """Release the prefill's lease of params no decode received (the client left before the
    decode started, no decode took it, it finished on another pool) through a decode at once,
    instead of pinning the prompt's KV for ``kv_lease_s`` (``router.api.unspent``)."""
    first_token_from_prefill: bool = True
    """Stream the token the prefill sampled at once and let the decode continue from it
    (``router.api.first_token``); off = classic P/D (the decode samples it again)."""
    disagg_min_prefill_tokens: int = 0
    """Selective disaggregation: a request whose prompt has fewer uncached tokens than this on
    the decode worker the decode policy picks goes there whole, skipping the prefill hop
    (``router.policy.disagg``); 0 disaggregates every request."""
    path_policy: str = "auto"
    """How a request's path is chosen: ``adaptive`` (the cost model of
    ``router.policy.adaptive`` picks whole or P/D per request among every engine), ``static``
    (the role fleet decides: P/D pools disaggregate, aggregated workers serve whole), ``auto``
    (adaptive when a flex worker is registered, else static), or ``whole``/``pd`` (adaptive
    forced to that kind of path wherever one exists; tests and benchmarks)."""
    path_costs_file: str | None = None
    """Instance profile (``pdserve bench profile``'s JSON) the adaptive cost model starts from;
    None: ``router.policy.path_cost.PathCosts``' defaults (the tiny model on one CPU core)."""
    hold_prefills: bool = True
    """Adaptive paths may hold a request in the router until the answers its prefill would push
    past the TPOT SLO have finished (``router.policy.adaptive``, ``AdaptivePaths.defer``)."""
    adaptive_window_s: float = 10.0
    """How far back the adaptive split looks: the engines' prefill shares and the stall-sensitive
    demand decay with this time constant (``AdaptivePaths.share_window_s``). Shorter follows a
    shift in the load sooner and a burst's noise more."""
    expected_output_tokens: int = 128
    """Output length the adaptive decision assumes for a request without ``max_tokens``."""
    kv_events: bool = False
    """Follow the KV cache events of every prefill/aggregated worker that publishes them
    (``pdserve worker --kv-events-port``): the prefix-aware policies then learn what the engines
    stored and evicted instead of only what the router sent (``router.state.kv_events``)."""
    timeline_file: str | None = None
    """If set, every finished request's phase timeline is appended here as one JSON line
    (wall-clock events and phase durations; see ``router.api.timeline``)."""
    otlp_traces_endpoint: str | None = default("otlp_traces_endpoint")
    """OTLP endpoint for request traces (the flag vLLM uses); None = tracing off."""
    max_in_flight_per_worker: int = default("max_in_flight_per_worker")
    """Admission: a pool whose every worker runs this many requests answers 429 with
    ``Retry-After`` (0 = unbounded; see ``router.policy.admission``)."""
    admission_queue_slo_factor: float = default("admission_queue_slo_factor")
    """Admission: refuse (429) while even the least-loaded prefill worker's queue is predicted
    to take more than this many TTFT SLOs (0 = off)."""
    max_body_bytes: int = default("max_body_bytes")
    """Largest request body accepted (413 above)."""
    header_timeout_s: float = default("header_timeout_s")
    """A connection must deliver a complete request head this long after it was accepted or,
    kept alive, after the first byte of its next request; else it is closed without an answer
    (``router.http_protocol``; 0 = no deadline)."""
    body_timeout_s: float = default("body_timeout_s")
    """A request body must finish arriving this long after the router starts reading it: 408
    past it, nothing routed, the connection closed (0 = no deadline)."""
    max_connections: int = default("max_connections")
    """uvicorn's ``limit_concurrency``: a request arriving while this many connections are open
    (its own included) or this many requests run is answered 503 by uvicorn before the app
    (0 = unbounded; why it is off by default: ``router.settings``)."""
    max_prompt_tokens: int = default("max_prompt_tokens")
    """Longest prompt accepted in tokens (400 above; 0 = the model's context only)."""
    max_output_tokens: int = default("max_output_tokens")
    """Largest ``max_tokens`` accepted (400 above; 0 = the model's context only)."""
    request_timeout_s: float = default("request_timeout_s")
    """Deadline of a request until its answer starts (prefill, pull and the decode's first
    byte; a whole non-streamed answer): 504 past it (0 = only the per-call timeouts)."""
    max_concurrent_per_key: int = default("max_concurrent_per_key")
    """Requests one API key (every client, without keys) may have in flight; 429 beyond
    (0 = unbounded; ``router.api.limits``)."""
    answer_deadline_s: float = default("answer_deadline_s")
    """Longest an answer may run, stream included: then 504 or a final error event (0 = off)."""
    prefill_tokens_per_min_per_key: int = default("prefill_tokens_per_min_per_key")
    """Prompt tokens one API key (every client, without keys) may send per minute, a minute's
    worth at once at most; 429 ``token_rate_limit_exceeded`` beyond, before routing (0 = off;
    ``router.api.token_budget``)."""
    decode_tokens_per_min_per_key: int = default("decode_tokens_per_min_per_key")
    """Output tokens one API key may ask for per minute: charged ``max_tokens`` (or
    ``expected_output_tokens``) at admission, settled to the tokens generated (0 = off)."""
    cache_salt_per_key: bool = False
    """Give each API key its own vLLM ``cache_salt`` (derived from the key, never the key), so
    keys never share prefix-cache blocks nor the router's prefix hashes; a client's own salt is
    combined with its key's (``router.api.cache_salt``). No effect without ``api_keys``."""
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    """Accepted ``Authorization: Bearer`` keys (``--api-key``, repeatable; ``PDSERVE_API_KEY``,
    comma-separated); empty = no authentication. ``/health`` and ``/metrics`` stay open."""
    admin_api_keys: tuple[str, ...] = field(default=(), repr=False)
    """Keys that may also read ``/workers`` (``--admin-api-key``; ``PDSERVE_ADMIN_API_KEY``):
    with ``api_keys`` set, ``/workers`` (internal URLs, loads, the cache model's view of any
    prompt) answers 403 to every other key; admin keys pass everywhere."""
    cluster_secret: str | None = field(default=None, repr=False)
    """Cluster keyring text (``PDSERVE_CLUSTER_SECRET``): the router signs every
    ``kv_transfer_params`` it sends so workers act only on its (kvtransfer.signing)."""
    cluster_secret_file: str | None = None
    """Keyring file (``PDSERVE_CLUSTER_SECRET_FILE``), re-read on change (rotation)."""

    def __post_init__(self) -> None:
        from router.policy.registry import DECODE_POLICIES, PREFILL_POLICIES

        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535, got {self.port}")
        if self.listen_fd < -1:
            raise ConfigError(f"listen_fd must be a file descriptor or -1, got {self.listen_fd}")
        if self.policy not in PREFILL_POLICIES:
            raise ConfigError(
                f"unknown policy {self.policy!r}; allowed: {', '.join(sorted(PREFILL_POLICIES))}"
            )
        if self.decode_policy not in DECODE_POLICIES:
            raise ConfigError(
                f"unknown decode_policy {self.decode_policy!r}; "
                f"allowed: {', '.join(sorted(DECODE_POLICIES))}"
            )
        if self.path_policy not in PATH_POLICIES:
            raise ConfigError(f"unknown path_policy {self.path_policy!r}; allowed: "
                              f"{', '.join(PATH_POLICIES)}")
        if self.expected_output_tokens < 1:
            raise ConfigError("expected_output_tokens must be >= 1")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(
                f"unknown log_level {self.log_level!r}; allowed: {', '.join(LOG_LEVELS)}"
            )
        for name in ("refresh_interval_s", "connect_timeout_s", "prefill_timeout_s",
                     "decode_timeout_s", "max_upstream_connections", "ttft_slo_s",
                     "prefill_s_per_token", "tpot_slo_s", "adaptive_window_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("prefill_retries", "decode_retries", "failure_cooldown_s", "no_worker_wait_s",
                     "migration_limit", "stall_timeout_s", "max_in_flight_per_worker",
                     "admission_queue_slo_factor", "max_body_bytes", "header_timeout_s",
                     "body_timeout_s", "max_connections", "max_prompt_tokens",
                     "max_output_tokens", "request_timeout_s",
                     "max_concurrent_per_key", "answer_deadline_s",
                     "prefill_tokens_per_min_per_key", "decode_tokens_per_min_per_key",
                     "load_poll_interval_s", "disagg_min_prefill_tokens",
                     "redispatch_interval_s", "warm_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if any(not k or k != k.strip() for k in (*self.api_keys, *self.admin_api_keys)):
            raise ConfigError("api keys must be non-empty and have no surrounding spaces")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(
                f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}"
            )


def package_version() -> str:
    """The installed pdserve version (``0+unknown`` when run from a tree not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "0+unknown"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve-router",
        description="OpenAI-compatible router in front of vLLM prefill/decode pools. "
        "Settings shared with other pdserve commands read PDSERVE_<FLAG> (e.g. "
        f"PDSERVE_TTFT_SLO_S); the router's own read {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}PORT).",
    )
    p.add_argument("--host", help="bind address (PDSERVE_ROUTER_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (PDSERVE_ROUTER_PORT, default 8000)")
    p.add_argument("--listen-fd", dest="listen_fd", type=int,
                   help="serve on this inherited listening socket instead of binding "
                   "--host/--port (PDSERVE_ROUTER_LISTEN_FD; pdserve up passes one it keeps "
                   "across router restarts)")
    shared.add_arguments(p, "router")
    p.add_argument("--load-poll-interval-s", dest="load_poll_interval_s", type=float,
                   help="seconds between reads of each worker's /metrics for its load "
                   "(PDSERVE_ROUTER_LOAD_POLL_INTERVAL_S, default 1.0; 0 = off)")
    p.add_argument("--first-token-from-prefill", dest="first_token_from_prefill",
                   action=argparse.BooleanOptionalAction,
                   help="stream the prefill's sampled token at once "
                   "(PDSERVE_ROUTER_FIRST_TOKEN_FROM_PREFILL, default on)")
    p.add_argument("--role-fallback", dest="role_fallback",
                   action=argparse.BooleanOptionalAction,
                   help="serve whole requests on the other pool when the prefill or decode "
                   "pool is empty or failed (PDSERVE_ROUTER_ROLE_FALLBACK, default on; off: 503)")
    p.add_argument("--release-unspent-kv", dest="release_unspent_kv",
                   action=argparse.BooleanOptionalAction,
                   help="free at once the prefill KV of requests that ended before a decode "
                   "received it (PDSERVE_ROUTER_RELEASE_UNSPENT_KV, default on; off: it stays "
                   "pinned until the lease expires)")
    p.add_argument("--cache-salt-per-key", dest="cache_salt_per_key",
                   action=argparse.BooleanOptionalAction,
                   help="set each API key's own vLLM cache_salt on its requests, so keys share "
                   "no prefix-cache blocks (PDSERVE_ROUTER_CACHE_SALT_PER_KEY, default off; "
                   "needs --api-key)")
    p.add_argument("--migration-limit", dest="migration_limit", type=int,
                   help="moves of one stream to another worker when its worker fails "
                   "mid-stream (PDSERVE_ROUTER_MIGRATION_LIMIT, default 3; 0 = off)")
    p.add_argument("--stall-timeout-s", dest="stall_timeout_s", type=float,
                   help="silence after output that moves a stream to another worker "
                   "(PDSERVE_ROUTER_STALL_TIMEOUT_S, default 3; 0 = off)")
    p.add_argument("--redispatch-interval-s", dest="redispatch_interval_s", type=float,
                   help="how often requests still queued on a busy worker move to one of their "
                   "pool that would start them sooner, e.g. one that just joined "
                   "(PDSERVE_ROUTER_REDISPATCH_INTERVAL_S, default 1; 0 = off)")
    p.add_argument("--warm-tokens", dest="warm_tokens", type=int,
                   help="prompt tokens sent to warm the prefix cache of a worker that joins "
                   "with the recent prompts it would now get that a peer caches "
                   "(PDSERVE_ROUTER_WARM_TOKENS, default 16384; 0 = off)")
    p.add_argument("--disagg-min-prefill-tokens", dest="disagg_min_prefill_tokens", type=int,
                   help="selective disaggregation: prompts with fewer uncached tokens (on the "
                   "chosen decode worker) skip the prefill hop "
                   "(PDSERVE_ROUTER_DISAGG_MIN_PREFILL_TOKENS, default 0 = always P/D)")
    p.add_argument("--path-policy", dest="path_policy", choices=PATH_POLICIES,
                   help="adaptive: pick whole or P/D per request from predicted TTFT/TPOT; "
                   "static: the worker roles decide; auto: adaptive when a flex worker is "
                   "registered (default); whole/pd: force that path (PDSERVE_ROUTER_PATH_POLICY)")
    p.add_argument("--path-costs", dest="path_costs_file", metavar="FILE",
                   help="instance profile from `pdserve bench profile` the adaptive cost model "
                   "starts from (PDSERVE_ROUTER_PATH_COSTS)")
    p.add_argument("--hold-prefills", dest="hold_prefills",
                   action=argparse.BooleanOptionalAction,
                   help="adaptive paths: hold a request until the answers its prefill would "
                   "push past the TPOT SLO have finished, instead of stalling them or moving "
                   "it P/D (PDSERVE_ROUTER_HOLD_PREFILLS, default on)")
    p.add_argument("--adaptive-window-s", dest="adaptive_window_s", type=float,
                   help="adaptive paths: the time constant the split's view of the load decays "
                   "with (PDSERVE_ROUTER_ADAPTIVE_WINDOW_S, default 10)")
    p.add_argument("--expected-output-tokens", dest="expected_output_tokens", type=int,
                   help="output length assumed for requests without max_tokens "
                   "(PDSERVE_ROUTER_EXPECTED_OUTPUT_TOKENS, default 128)")
    p.add_argument("--kv-events", dest="kv_events", action=argparse.BooleanOptionalAction,
                   help="learn the prefill engines' cache from their KV cache events (workers "
                   "started with --kv-events-port; PDSERVE_ROUTER_KV_EVENTS, default off)")
    p.add_argument("--timeline-file", dest="timeline_file",
                   help="append each request's phase timeline as a JSON line "
                   "(PDSERVE_ROUTER_TIMELINE_FILE)")
    p.add_argument("--api-key", dest="api_keys", action="append",
                   help="require 'Authorization: Bearer <key>' on the API and /workers "
                   "(repeatable; PDSERVE_API_KEY, comma-separated)")
    p.add_argument("--admin-api-key", dest="admin_api_keys", action="append",
                   help="a key that may also read /workers (repeatable; PDSERVE_ADMIN_API_KEY, "
                   "comma-separated); with --api-key set, other keys get 403 there")
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    return p


# settings field -> env var suffix (the flag name, upper-cased); the shared settings
# (router.settings.COMMANDS["router"]) are read there
_ENV_NAMES = {
    "host": "HOST",
    "port": "PORT",
    "listen_fd": "LISTEN_FD",
    "redis_prefix": "REDIS_PREFIX",
    "refresh_interval_s": "REFRESH_INTERVAL_S",
    "connect_timeout_s": "CONNECT_TIMEOUT_S",
    "prefill_timeout_s": "PREFILL_TIMEOUT_S",
    "decode_timeout_s": "DECODE_TIMEOUT_S",
    "prefill_retries": "PREFILL_RETRIES",
    "decode_retries": "DECODE_RETRIES",
    "failure_cooldown_s": "FAILURE_COOLDOWN_S",
    "no_worker_wait_s": "NO_WORKER_WAIT_S",
    "migration_limit": "MIGRATION_LIMIT",
    "stall_timeout_s": "STALL_TIMEOUT_S",
    "redispatch_interval_s": "REDISPATCH_INTERVAL_S",
    "warm_tokens": "WARM_TOKENS",
    "max_upstream_connections": "MAX_UPSTREAM_CONNECTIONS",
    "load_poll_interval_s": "LOAD_POLL_INTERVAL_S",
    "first_token_from_prefill": "FIRST_TOKEN_FROM_PREFILL",
    "release_unspent_kv": "RELEASE_UNSPENT_KV",
    "role_fallback": "ROLE_FALLBACK",
    "cache_salt_per_key": "CACHE_SALT_PER_KEY",
    "disagg_min_prefill_tokens": "DISAGG_MIN_PREFILL_TOKENS",
    "timeline_file": "TIMELINE_FILE",
    "path_policy": "PATH_POLICY",
    "path_costs_file": "PATH_COSTS",
    "hold_prefills": "HOLD_PREFILLS",
    "adaptive_window_s": "ADAPTIVE_WINDOW_S",
    "expected_output_tokens": "EXPECTED_OUTPUT_TOKENS",
    "kv_events": "KV_EVENTS",
}


def load(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> RouterSettings:
    """Build settings from defaults < env vars (``PDSERVE_ROUTER_*``; the shared settings'
    ``PDSERVE_*``, see ``router.settings``) < CLI flags."""
    env = os.environ if env is None else env
    types = {f.name: f.type for f in fields(RouterSettings)}
    values: dict[str, object] = {}
    for name, suffix in _ENV_NAMES.items():
        raw = env.get(ENV_PREFIX + suffix)
        if raw is None or raw == "":
            continue
        kind = types[name]
        try:
            if kind in ("int", int):
                values[name] = int(raw)
            elif kind in ("float", float):
                values[name] = float(raw)
            elif kind in ("bool", bool):
                if raw.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                    raise ValueError(raw)
                values[name] = raw.lower() in ("1", "true", "yes", "on")
            else:
                values[name] = raw
        except ValueError as exc:
            raise ConfigError(f"{ENV_PREFIX + suffix}={raw!r} is not a valid {kind}") from exc
    keys = env.get("PDSERVE_API_KEY")
    if keys:
        values["api_keys"] = tuple(k.strip() for k in keys.split(",") if k.strip())
    admin = env.get("PDSERVE_ADMIN_API_KEY")
    if admin:
        values["admin_api_keys"] = tuple(k.strip() for k in admin.split(",") if k.strip())
    values["cluster_secret"] = env.get("PDSERVE_CLUSTER_SECRET") or None
    values["cluster_secret_file"] = env.get("PDSERVE_CLUSTER_SECRET_FILE") or None
    args = _parser().parse_args(list(argv) if argv is not None else None)
    for name, r in shared.resolve(args, "router", env).items():
        values[name] = r.value
    own = {f.name for f in fields(RouterSettings)} - set(shared.COMMANDS["router"])
    for name, value in vars(args).items():
        if value is not None and name in own:
            values[name] = tuple(value) if name in ("api_keys", "admin_api_keys") else value
    settings = RouterSettings(**values)  # type: ignore[arg-type]
    _check_keyring(settings)
    return settings


def _check_keyring(settings: RouterSettings) -> None:
    """A cluster secret the router could not use (unreadable, too short) stops it here with the
    reason, rather than as a traceback when the app is built."""
    from kvtransfer.signing import keyring_source

    try:
        keyring_source(settings.cluster_secret, settings.cluster_secret_file)
    except ValueError as exc:
        raise ConfigError(f"cluster secret: {exc}") from exc
