"""The settings several pdserve commands share: one flag, one env var, one default each.

Every command that reads one of these settings (``pdserve up``, ``pdserve router``, ``pdserve
worker``, ``pdserve autoscale``, ``pdserve bench``, ``pdserve sim``, ``pdserve config show``)
adds its flags with :func:`add_arguments` and reads the values with :func:`resolve`, so a name
or a default cannot diverge again (``tests/unit/test_shared_settings.py`` builds every
command's parser and checks). It lives in ``router`` because that is the lowest package every
command may import (``serve`` and ``bench`` import ``router``; ``router`` imports neither).

Naming: the flag is ``--<stem>``, the env var ``PDSERVE_<STEM>`` (upper-cased, ``-`` -> ``_``).
Settings only one process reads keep that process's prefix (``PDSERVE_ROUTER_*``,
``PDSERVE_WORKER_*``, ``PDSERVE_AUTOSCALE_*``). Precedence: flag > env var > default. Old
spellings (``--redis``, ``--slo-ttft``, ``PDSERVE_ROUTER_POLICY``, ...) still work, log a
deprecation warning, and lose to the canonical ones when both are given.

The defaults (every one a value that works on a laptop without a GPU):

- ``ttft_slo_s`` = 1.0 s. The router's DualMap leaves cache affinity for load when a
  candidate's predicted TTFT passes half of it, admission refuses when the shortest prefill
  queue is predicted past ``admission_queue_slo_factor`` of it, and the autoscaler sizes the
  prefill pool so the p90 TTFT meets it: all three must aim at one number or the autoscaler
  adds workers the router never asks for (it was 5 s in the router, 1 s in the autoscaler).
  1 s is what an interactive chat user tolerates before the first token, the autoscaler's
  planner default (``PlannerConfig``) and the SLO of the P/D goodput benchmark.
- ``tpot_slo_s`` = 0.1 s (10 tokens/s, faster than reading speed): the planner's default.
- ``redis_url`` = ``redis://127.0.0.1:6379/0`` (``pdserve up`` starts one there if none
  answers). A standalone ``pdserve worker`` registers only when given one (:data:`OVERRIDES`).
- ``kv_lease_s`` = 30 s and ``kv_pull_timeout_s`` = 20 s: the KV connector's own defaults
  (``kvtransfer.config.ConnectorConfig``); the lease outlives a pull by a margin.
- ``header_timeout_s`` = 10 s, ``body_timeout_s`` = 30 s: slow clients (security review
  finding 12). A request head is a few hundred bytes, so 10 s is long for any real client
  and short for a connection held open by trickling it (slowloris); 30 s takes an 8 MiB body
  (``max_body_bytes``) at 280 KB/s. ``max_connections`` = 0 (off): uvicorn's
  ``limit_concurrency`` refuses requests, not connections (a connection past it is still
  accepted and costs its descriptor until a deadline or the keep-alive timeout closes it),
  and the number a router can carry depends on its descriptor limit and its streams, so it is
  a capacity knob for the operator; per-key limits (``max_concurrent_per_key``) share the
  router fairly.
- The router's placement, admission and limit defaults are unchanged (``router.config``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from router.errors import ConfigError

logger = logging.getLogger(__name__)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_SOURCES = "_pdserve_flag_sources"


def _log_level(raw: str) -> str:
    level = raw.strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"unknown log level {raw!r}; allowed: {', '.join(LOG_LEVELS)}")
    return level


REDIS_SCHEMES = ("redis", "rediss", "unix")


def _redis_url(raw: str) -> str:
    scheme = raw.partition("://")[0].lower() if "://" in raw else ""
    if scheme not in REDIS_SCHEMES:
        raise ValueError(f"not a Redis URL: {raw!r} (the scheme must be one of "
                         f"{', '.join(x + '://' for x in REDIS_SCHEMES)})")
    return raw


def _optional_str(raw: str) -> str | None:
    return raw or None


@dataclass(frozen=True)
class Setting:
    """One shared setting: its canonical flag and env var, its default, its old spellings."""

    name: str
    """Field name in the commands' typed settings (``ttft_slo_s``)."""
    default: Any
    """The one default every command uses (unless :data:`OVERRIDES` says why not)."""
    parse: Callable[[str], Any]
    """Turns flag or env text into the value; ``ValueError`` on bad text."""
    help: str
    deprecated_flags: tuple[str, ...] = ()
    """Old flag spellings: still accepted, with a warning."""
    deprecated_envs: tuple[str, ...] = ()
    """Old env var names: still read (after the canonical one), with a warning."""
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "PDSERVE_" + self.name.upper()


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("redis_url", "redis://127.0.0.1:6379/0", _redis_url,
            "Redis holding the worker registry", ("--redis",), ("PDSERVE_ROUTER_REDIS",), "URL"),
    Setting("log_level", "INFO", _log_level, "log level (DEBUG, INFO, WARNING, ERROR)",
            deprecated_envs=("PDSERVE_ROUTER_LOG_LEVEL",), metavar="LEVEL"),
    Setting("ttft_slo_s", 1.0, float,
            "TTFT SLO in seconds: DualMap's load switch, admission, autoscaling",
            ("--slo-ttft",), ("PDSERVE_ROUTER_TTFT_SLO_S", "PDSERVE_SLO_TTFT_S"), "S"),
    Setting("tpot_slo_s", 0.1, float, "TPOT SLO in seconds (time per output token)",
            ("--slo-tpot",), ("PDSERVE_SLO_TPOT_S",), "S"),
    Setting("policy", "dualmap", str,
            "prefill placement policy (dualmap, round_robin, least_loaded, consistent_hash, "
            "bounded_load_hash, prefix_only)", deprecated_envs=("PDSERVE_ROUTER_POLICY",)),
    Setting("decode_policy", "least_loaded", str,
            "decode placement policy (least_loaded, kv_aware, round_robin)",
            deprecated_envs=("PDSERVE_ROUTER_DECODE_POLICY",)),
    Setting("prefill_s_per_token", 1e-4, float,
            "calibrated prefill seconds per uncached token (DualMap's and admission's TTFT "
            "prediction)", deprecated_envs=("PDSERVE_ROUTER_PREFILL_S_PER_TOKEN",), metavar="S"),
    Setting("max_in_flight_per_worker", 0, int,
            "429 when every worker of a pool runs this many requests (0 = unbounded)",
            deprecated_envs=("PDSERVE_ROUTER_MAX_IN_FLIGHT_PER_WORKER",), metavar="N"),
    Setting("admission_queue_slo_factor", 2.0, float,
            "429 while the shortest prefill queue is predicted past this many TTFT SLOs "
            "(0 = off)", deprecated_envs=("PDSERVE_ROUTER_ADMISSION_QUEUE_SLO_FACTOR",),
            metavar="X"),
    Setting("request_timeout_s", 0.0, float,
            "504 when the answer has not started within this (prefill, pull, first decode "
            "byte; 0 = only the per-call timeouts)",
            deprecated_envs=("PDSERVE_ROUTER_REQUEST_TIMEOUT_S",), metavar="S"),
    Setting("max_concurrent_per_key", 0, int,
            "429 when an API key (every client, without keys) already has this many requests "
            "in flight (0 = unbounded)", metavar="N"),
    Setting("answer_deadline_s", 0.0, float,
            "stop any answer still running after this (504, or an error event ending the "
            "stream; 0 = no deadline)", metavar="S"),
    Setting("prefill_tokens_per_min_per_key", 0, int,
            "429 when an API key (every client, without keys) would send more prompt tokens "
            "than this per minute (a minute's worth may come at once; 0 = unbounded)",
            metavar="N"),
    Setting("decode_tokens_per_min_per_key", 0, int,
            "429 when an API key (every client, without keys) would ask for more output "
            "tokens than this per minute (max_tokens at admission, settled to the tokens "
            "generated; 0 = unbounded)", metavar="N"),
    Setting("max_body_bytes", 8 * 1024 * 1024, int, "413 above this request body size",
            deprecated_envs=("PDSERVE_ROUTER_MAX_BODY_BYTES",), metavar="N"),
    Setting("header_timeout_s", 10.0, float,
            "close a connection whose request head (request line and headers) is not complete "
            "this long after it was accepted, or after the first byte of its next request "
            "(0 = no deadline)", metavar="S"),
    Setting("body_timeout_s", 30.0, float,
            "408 when a request body has not finished arriving within this (0 = no deadline)",
            metavar="S"),
    Setting("max_connections", 0, int,
            "503 for a request that arrives while this many connections are open or requests "
            "are running (uvicorn's limit_concurrency; 0 = unbounded)", metavar="N"),
    Setting("max_prompt_tokens", 0, int,
            "400 above this prompt length (0 = the model's context)",
            deprecated_envs=("PDSERVE_ROUTER_MAX_PROMPT_TOKENS",), metavar="N"),
    Setting("max_output_tokens", 0, int,
            "400 when max_tokens exceeds this (0 = the model's context)",
            deprecated_envs=("PDSERVE_ROUTER_MAX_OUTPUT_TOKENS",), metavar="N"),
    Setting("otlp_traces_endpoint", None, _optional_str,
            "export OpenTelemetry request traces to this OTLP endpoint",
            deprecated_envs=("PDSERVE_ROUTER_OTLP_TRACES_ENDPOINT",), metavar="URL"),
    Setting("kv_lease_s", 30.0, float,
            "seconds a prefill worker keeps a finished request's KV for the decode's pull",
            ("--lease-s",), metavar="S"),
    Setting("kv_pull_timeout_s", 20.0, float,
            "deadline of one KV pull in seconds; past it the decode recomputes",
            ("--pull-timeout-s",), metavar="S"),
)}
"""Every shared setting by name."""

ROUTER_FORWARDED = ("policy", "decode_policy", "ttft_slo_s", "tpot_slo_s",
                    "prefill_s_per_token",
                    "max_in_flight_per_worker", "admission_queue_slo_factor",
                    "request_timeout_s", "max_body_bytes", "header_timeout_s",
                    "body_timeout_s", "max_connections", "max_prompt_tokens",
                    "max_output_tokens", "max_concurrent_per_key", "answer_deadline_s",
                    "prefill_tokens_per_min_per_key", "decode_tokens_per_min_per_key")
"""Router settings ``pdserve up`` takes and passes on to its router."""

COMMANDS: dict[str, tuple[str, ...]] = {
    "router": ("redis_url", "log_level", "otlp_traces_endpoint", *ROUTER_FORWARDED),
    "worker": ("redis_url", "log_level", "otlp_traces_endpoint", "kv_lease_s",
               "kv_pull_timeout_s"),
    "autoscale": ("redis_url", "log_level", "ttft_slo_s", "tpot_slo_s"),
    "autoscale status": ("redis_url",),
    "drain": ("redis_url",),
    "up": ("redis_url", "log_level", "otlp_traces_endpoint", *ROUTER_FORWARDED,
           "kv_lease_s", "kv_pull_timeout_s"),
    "bench": ("ttft_slo_s", "tpot_slo_s"),
    "sim": ("ttft_slo_s", "tpot_slo_s"),
    "chaos": ("log_level", "kv_lease_s"),
}
"""Which shared settings each command takes (``bench``: its replay and sweep subcommands;
``drain``: ``python -m router.autoscale.drain``, the pods' preStop hook)."""

OVERRIDES: dict[tuple[str, str], Any] = {
    ("worker", "redis_url"): None,
    ("drain", "redis_url"): "redis://pdserve-redis:6379/0",
    ("chaos", "kv_lease_s"): 10.0,
}
"""The only per-command defaults, each with its reason: a standalone ``pdserve worker`` (a
plain vLLM server with the connector, e.g. for benchmarks) registers in Redis only when told
where (``pdserve up`` always tells its workers); the drain hook runs only in Kubernetes pods,
where Redis is the ``pdserve-redis`` Service (``deploy/k8s/base/redis.yaml``); ``pdserve
chaos`` runs its own cluster with short leases so that its faults see leases expire (and
stranded KV freed) within the run."""


def default(name: str, command: str | None = None) -> Any:
    """The default of ``name`` (in ``command``, where :data:`OVERRIDES` differs)."""
    if command is not None and (command, name) in OVERRIDES:
        return OVERRIDES[(command, name)]
    return SETTINGS[name].default


def _names(command: str | None, names: Iterable[str] | None) -> tuple[str, ...]:
    if names is not None:
        return tuple(names)
    return COMMANDS[command] if command is not None else tuple(SETTINGS)


def used_by(name: str) -> tuple[str, ...]:
    """The commands that take ``name``."""
    return tuple(c for c, names in COMMANDS.items() if name in names)


class _Record(argparse.Action):
    """Stores the value and which spelling gave it; warns on a deprecated one."""

    def __init__(self, option_strings: list[str], dest: str, canonical: str = "",
                 **kwargs: Any) -> None:
        self.canonical = canonical
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if option_string != self.canonical:
            logger.warning("%s is deprecated; use %s", option_string, self.canonical)
        setattr(namespace, self.dest, values)
        sources = dict(getattr(namespace, _SOURCES, {}))
        sources[self.dest] = option_string or self.canonical
        setattr(namespace, _SOURCES, sources)


def _checked(setting: Setting) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        try:
            return setting.parse(raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    parse.__name__ = setting.name
    return parse


def add_arguments(parser: argparse.ArgumentParser, command: str | None,
                  names: Iterable[str] | None = None) -> None:
    """Add the canonical flags (and hidden deprecated ones) of ``command``'s shared settings.

    Values stay off the namespace unless given on the command line: :func:`resolve` then fills
    in the env var or the default and tells which it was.
    """
    for name in _names(command, names):
        s = SETTINGS[name]
        shown = default(name, command)
        parser.add_argument(s.flag, dest=name, action=_Record, canonical=s.flag,
                            type=_checked(s), default=argparse.SUPPRESS, metavar=s.metavar,
                            help=f"{s.help} ({s.env}; default {shown})")
        for old in s.deprecated_flags:
            parser.add_argument(old, dest=name, action=_Record, canonical=s.flag,
                                type=_checked(s), default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS)


@dataclass(frozen=True)
class Resolved:
    """The value a command uses for one setting and where it came from."""

    value: Any
    source: str
    """``default``, ``env PDSERVE_X``, ``flag --x`` (a deprecated spelling says so)."""


def resolve(args: argparse.Namespace | None, command: str | None,
            env: Mapping[str, str] | None = None,
            names: Iterable[str] | None = None) -> dict[str, Resolved]:
    """Value and source of each of ``command``'s shared settings (``names``; with neither,
    every one): flag > env var > default."""
    env = os.environ if env is None else env
    given = vars(args) if args is not None else {}
    flag_sources: dict[str, str] = given.get(_SOURCES, {})
    out: dict[str, Resolved] = {}
    for name in _names(command, names):
        s = SETTINGS[name]
        if name in given:
            flag = flag_sources.get(name, s.flag)
            note = " (deprecated)" if flag != s.flag else ""
            out[name] = Resolved(given[name], f"flag {flag}{note}")
            continue
        out[name] = Resolved(default(name, command), "default")
        for var in (s.env, *s.deprecated_envs):
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            try:
                value = s.parse(raw)
            except ValueError as exc:
                raise ConfigError(f"{var}={raw!r}: {exc}") from exc
            if var != s.env:
                logger.warning("%s is deprecated; use %s", var, s.env)
                out[name] = Resolved(value, f"env {var} (deprecated)")
            else:
                out[name] = Resolved(value, f"env {var}")
            break
    return out


def resolve_into(args: argparse.Namespace, command: str,
                 env: Mapping[str, str] | None = None) -> dict[str, Resolved]:
    """:func:`resolve`, then set each value on ``args`` (``args.ttft_slo_s``, ...)."""
    resolved = resolve(args, command, env)
    for name, r in resolved.items():
        setattr(args, name, r.value)
    return resolved


def resolve_for_cli(args: argparse.Namespace, command: str, prog: str) -> bool:
    """:func:`resolve_into` for a command's ``main``: False, after printing ``prog: reason`` to
    stderr, when an env var holds a bad value (the caller then exits with status 2)."""
    try:
        resolve_into(args, command)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return False
    return True


def to_flags(command: str, values: Mapping[str, Any]) -> list[str]:
    """Canonical flags that hand ``values`` (name -> value) to a ``command`` child process;
    settings the child does not take, and None values, are left out."""
    taken = set(COMMANDS[command])
    flags: list[str] = []
    for name, value in values.items():
        if name in taken and value is not None:
            flags.append(f"{SETTINGS[name].flag}={value}")
    return flags
