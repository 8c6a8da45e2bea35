"""`pdserve bench`: replay, synth, sweep, compare, profile.

    pdserve bench replay --trace FILE.csv --url http://HOST:PORT [--model NAME]
        [--time-scale X | --rate R] [--start S] [--duration S] [--ttft-slo-s S --tpot-slo-s S]
        [--max-concurrency N] [--percentiles 50,90,99] --out DIR [--seed S]
    pdserve bench replay --synthetic --num-prompts 100 --input-len 512 --output-len 64
        --request-rate 4 --url URL --out DIR
    pdserve bench synth --out FILE.csv [--duration S] [--rate R] [--dispersion D] [--layout v2]
    pdserve bench sweep --trace FILE.csv --url URL --rates 1,2,4,8 [--ttft-slo-s S --tpot-slo-s S]
        --out DIR
    pdserve bench compare A.json B.json
    pdserve bench profile --url URL --out profile.json

``--start``/``--duration`` select a window of the trace in trace seconds (from its first row);
``--time-scale``/``--rate`` then compress that window. Times everywhere are seconds.
``--synthetic`` replaces the trace with a fixed shape (``vllm bench serve``'s random dataset with
no length spread): Poisson arrivals at ``--request-rate`` (default inf: all at once).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.client import ClientConfig, RequestResult, RequestSpec, RunResult, run_open_loop
from bench.metrics import PERCENTILES, SCHEDULE_LAG_LIMIT_S, parse_percentiles, summarize
from bench.prompts import PromptSynthesizer, load_tokenizer
from bench.report import (
    RUN_SCHEMA,
    SWEEP_SCHEMA,
    compare_table,
    markdown_summary,
    plot_run,
    plot_sweep,
    require_optional,
    run_document,
    write_json,
    write_requests_csv,
)
from bench.synth import SynthConfig, fixed_shape_rows, synth_rows
from bench.trace import (
    TraceError,
    TraceRow,
    TraceStats,
    clamp_to_context,
    read_trace,
    schedule,
    write_trace,
)
from router import settings as shared

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Workload preparation


@dataclass
class ServerInfo:
    """What ``GET /v1/models`` says about the served model."""

    model: str
    root: str | None = None
    max_model_len: int | None = None


def server_root(url: str) -> str:
    """``--url`` as the server root: the ``.../v1`` base URL OpenAI clients (and the
    `pdserve ready` line) use works too."""
    root = url.strip().rstrip("/")
    return root.removesuffix("/v1").rstrip("/") if root.endswith("/v1") else root


def server_info(url: str, model: str | None = None, timeout_s: float = 10.0,
                api_key: str | None = None) -> ServerInfo:
    """Served model name (the first one unless ``model`` is given), its path and context
    (``api_key``: the server's bearer token, when it asks for one)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        resp = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=timeout_s, headers=headers)
        resp.raise_for_status()
        data = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        if model is None:
            raise SystemExit(f"cannot list models at {url}/v1/models: {exc}; is --url the "
                             "server (http://HOST:PORT or http://HOST:PORT/v1) and is it up? "
                             "(--model skips this listing)") from exc
        return ServerInfo(model)
    entry = next((d for d in data if d.get("id") == model), data[0] if data else {})
    name = model or entry.get("id")
    if not name:
        raise SystemExit(f"{url}/v1/models lists no model; pass --model")
    return ServerInfo(name, entry.get("root"), entry.get("max_model_len"))


def tokenizer_for(args: argparse.Namespace, info: ServerInfo) -> Any:
    """``--tokenizer``, else the model dir the server reports, else its model name."""
    source = args.tokenizer or info.root or info.model
    try:
        return load_tokenizer(source)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"cannot load tokenizer {source!r} ({exc}); pass --tokenizer") from exc


@dataclass
class Workload:
    """Requests to send plus what the trace reader reported."""

    specs: list[RequestSpec]
    rows: list[TraceRow]
    trace_meta: dict[str, Any]


def load_rows(args: argparse.Namespace, stats: TraceStats) -> list[TraceRow]:
    try:
        return list(read_trace(args.trace, models=args.trace_model, log_types=args.log_type,
                               start_s=args.start, duration_s=args.duration,
                               max_requests=args.max_requests, stats=stats))
    except (TraceError, OSError) as exc:
        raise SystemExit(f"trace: {exc}") from exc


def build_workload(rows: list[TraceRow], stats: TraceStats, synth: PromptSynthesizer, *,
                   time_scale: float | None, rate: float | None, duration_s: float | None,
                   max_input_tokens: int | None, max_output_tokens: int | None,
                   max_model_len: int | None) -> Workload:
    """Schedule ``rows`` and synthesize their prompts (clamped to fit the server's context)."""
    sched, scale = schedule(rows, time_scale=time_scale, rate=rate, duration_s=duration_s)
    specs: list[RequestSpec] = []
    clamped = 0
    for i, s in enumerate(sched):
        r = s.row
        n_in, n_out = r.request_tokens, r.response_tokens
        if max_input_tokens is not None:
            n_in = min(n_in, max_input_tokens)
        if max_output_tokens is not None:
            n_out = min(n_out, max_output_tokens)
        if max_model_len is not None:
            n_in, n_out = clamp_to_context(n_in, n_out, max_model_len)
        clamped += (n_in, n_out) != (r.request_tokens, r.response_tokens)
        session = r.session_id if r.log_type.lower().startswith("conv") else None
        p = synth.prompt(n_in, session_id=session, response_tokens=n_out,
                         api=r.log_type.lower().startswith("api"))
        specs.append(RequestSpec(i, s.at_s, p.text, p.num_tokens, n_out, r.session_id,
                                 r.log_type, r.line))
    span = sched[-1].at_s if sched else 0.0
    meta = {**stats.as_dict(), "time_scale": scale, "requests": len(specs),
            "clamped_requests": clamped, "replay_span_s": span,
            "offered_rate_rps": (len(specs) - 1) / span if span > 0 else None}
    return Workload(specs, rows, meta)


# ---------------------------------------------------------------------------------------------
# Running


async def _run_with_progress(specs: list[RequestSpec], cfg: ClientConfig,
                             progress: bool) -> RunResult:
    if not progress:
        return await run_open_loop(specs, cfg)
    rp = require_optional("rich.progress")
    with rp.Progress(rp.TextColumn("{task.description}"), rp.BarColumn(),
                     rp.TextColumn("{task.completed}/{task.total}"), rp.TimeElapsedColumn(),
                     transient=False) as bar:
        task = bar.add_task("requests", total=len(specs))
        failed = 0

        def done(r: RequestResult) -> None:
            nonlocal failed
            failed += not r.ok
            bar.update(task, advance=1, description=f"requests (failed {failed})")

        return await run_open_loop(specs, cfg, on_done=done)


def write_run(out: Path, run: RunResult, wl: Workload, config: dict[str, Any],
              slo_ttft_s: float | None, slo_tpot_s: float | None,
              plots: bool = True, percentiles: tuple[float, ...] = PERCENTILES,
              max_concurrency: int | None = None) -> dict[str, Any]:
    """summary.json, requests.csv, report.md and plots under ``out``; returns the document."""
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(run.results, run.duration_s, slo_ttft_s=slo_ttft_s,
                        slo_tpot_s=slo_tpot_s, percentiles=percentiles)
    # the run parameters `vllm bench serve` writes beside its metrics, in its form
    rate = config.get("request_rate") or wl.trace_meta.get("offered_rate_rps")
    summary.update(max_concurrency=max_concurrency, num_prompts=len(wl.specs),
                   request_rate="inf" if rate == float("inf") else rate)
    if not summary["timing_valid"]:
        logger.warning("the client fell behind its schedule (p99 send lag %.1f ms > %.0f ms): "
                       "this run's latencies include client delay; run the client on its own "
                       "cores or lower the rate", 1e3 * summary["schedule_lag_p99"],
                       1e3 * SCHEDULE_LAG_LIMIT_S)
    doc = run_document(summary, {**config, "started_unix_s": run.started_wall}, wl.trace_meta)
    meta = {s.index: {"trace_line": s.trace_line, "session_id": s.session_id}
            for s in wl.specs}
    write_requests_csv(out / "requests.csv", run.results, meta, slo_ttft_s, slo_tpot_s)
    write_json(out / "summary.json", doc)
    (out / "report.md").write_text(markdown_summary(doc), encoding="utf-8")
    if plots:
        plot_run(out, run.results)
    return doc


def _client_config(args: argparse.Namespace, model: str) -> ClientConfig:
    return ClientConfig(url=args.url, model=model, endpoint=args.endpoint,
                        timeout_s=args.timeout, ignore_eos=not args.no_ignore_eos,
                        api_key=args.api_key, max_concurrency=args.max_concurrency)


def _percentiles(args: argparse.Namespace) -> tuple[float, ...]:
    try:
        return parse_percentiles(args.percentiles)
    except ValueError as exc:
        raise SystemExit(f"--percentiles: {exc}") from exc


_SYNTHETIC_DEFAULTS = {"num_prompts": 1000, "input_len": 1024, "output_len": 128,
                       "request_rate": float("inf")}
"""``vllm bench serve``'s defaults for its random dataset."""


def _synthetic_rows(args: argparse.Namespace, stats: TraceStats) -> list[TraceRow]:
    given = [k for k in _SYNTHETIC_DEFAULTS if getattr(args, k, None) is not None]
    if not getattr(args, "synthetic", False):
        if given:
            raise SystemExit(f"--{given[0].replace('_', '-')} needs --synthetic")
        if args.trace is None:
            raise SystemExit("give --trace FILE or --synthetic")
        return []
    if args.trace is not None or args.time_scale is not None or args.rate is not None:
        raise SystemExit("--synthetic replaces --trace, --time-scale and --rate "
                         "(use --request-rate)")
    for k, v in _SYNTHETIC_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    try:
        rows = fixed_shape_rows(args.num_prompts, input_tokens=args.input_len,
                                output_tokens=args.output_len, rate=args.request_rate,
                                seed=args.seed)
    except ValueError as exc:
        raise SystemExit(f"--synthetic: {exc}") from exc
    stats.source, stats.layout = "synthetic", "fixed_shape"
    stats.rows_read = stats.rows_kept = len(rows)
    return rows


def _prepare(args: argparse.Namespace) -> tuple[ServerInfo, PromptSynthesizer, list[TraceRow],
                                                 TraceStats]:
    stats = TraceStats()
    rows = _synthetic_rows(args, stats) or load_rows(args, stats)
    if not rows:
        raise SystemExit(f"trace: no rows left after filters ({stats.as_dict()})")
    info = server_info(args.url, args.model)
    synth = PromptSynthesizer(tokenizer_for(args, info), seed=args.seed,
                              system_prompts=args.system_prompts,
                              system_prompt_tokens=args.system_prompt_tokens,
                              sessions=not args.no_sessions)
    return info, synth, rows, stats


def _workload(args: argparse.Namespace, info: ServerInfo, synth: PromptSynthesizer,
              rows: list[TraceRow], stats: TraceStats, *, rate: float | None) -> Workload:
    return build_workload(rows, stats, synth, time_scale=args.time_scale if rate is None
                          else None, rate=rate, duration_s=args.duration,
                          max_input_tokens=args.max_input_tokens,
                          max_output_tokens=args.max_output_tokens,
                          max_model_len=info.max_model_len)


def _config_doc(args: argparse.Namespace, info: ServerInfo, **extra: Any) -> dict[str, Any]:
    keep = ("trace", "url", "endpoint", "time_scale", "rate", "start", "duration",
            "max_requests", "trace_model", "log_type", "seed", "timeout", "max_input_tokens",
            "max_output_tokens", "system_prompts", "system_prompt_tokens", "no_sessions",
            "tokenizer", "max_concurrency", "percentiles", "synthetic",
            "num_prompts", "input_len", "output_len", "request_rate")
    doc = {k: getattr(args, k, None) for k in keep}
    doc.update(slo_ttft=args.ttft_slo_s, slo_tpot=args.tpot_slo_s)  # summary.json's names
    doc.update(model=info.model, model_root=info.root, max_model_len=info.max_model_len,
               ignore_eos=not args.no_ignore_eos, **extra)
    return doc


def cmd_replay(args: argparse.Namespace) -> int:
    info, synth, rows, stats = _prepare(args)
    wl = _workload(args, info, synth, rows, stats, rate=args.rate)
    logger.info("replaying %d requests over %.1f s against %s", len(wl.specs),
                wl.trace_meta["replay_span_s"], args.url)
    run = asyncio.run(_run_with_progress(wl.specs, _client_config(args, info.model),
                                         _progress(args)))
    doc = write_run(Path(args.out), run, wl, _config_doc(args, info), args.ttft_slo_s,
                    args.tpot_slo_s, plots=not args.no_plots, percentiles=_percentiles(args),
                    max_concurrency=args.max_concurrency)
    print(markdown_summary(doc))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from bench.sweep import rate_dir, sweep

    info, synth, rows, stats = _prepare(args)
    out = Path(args.out)
    cfg = _client_config(args, info.model)
    seed = args.seed

    async def run_at(rate: float) -> dict[str, Any]:
        # Same prompts at every rate: a fresh synthesizer with the same seed.
        s = PromptSynthesizer(synth.tok, seed=seed, system_prompts=args.system_prompts,
                              system_prompt_tokens=args.system_prompt_tokens,
                              sessions=not args.no_sessions)
        st = TraceStats(**{**asdict(stats), "dropped": dict(stats.dropped)})
        wl = _workload(args, info, s, rows, st, rate=rate)
        run = await _run_with_progress(wl.specs, cfg, _progress(args))
        return write_run(rate_dir(out, rate), run, wl, _config_doc(args, info, rate=rate),
                         args.ttft_slo_s, args.tpot_slo_s, plots=not args.no_plots,
                         percentiles=_percentiles(args), max_concurrency=args.max_concurrency)

    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    res = asyncio.run(sweep(run_at, rates, target=args.target, bisect_steps=args.bisect_steps))
    points = [{k: v for k, v in p.items() if k != "summary"} for p in res.points]
    doc = {"schema": SWEEP_SCHEMA, "target": args.target, "max_rate_rps": res.max_rate,
           "points": points, "config": _config_doc(args, info)}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "sweep.json", doc)
    if not args.no_plots:
        plot_sweep(out, points, args.target)
    lines = [f"# Rate sweep: {args.url}", "",
             f"Highest rate with SLO attainment >= {args.target:.0%}: "
             f"{res.max_rate if res.max_rate is not None else 'none'} req/s", "",
             "| rate (req/s) | attainment | pass |", "|---|---|---|"]
    lines += [f"| {p['rate']:.4g} | {p['slo_attainment']} | {p['passed']} |"
              for p in sorted(points, key=lambda p: p["rate"])]
    (out / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    cfg = SynthConfig(duration_s=args.duration, rate=args.rate, dispersion=args.dispersion,
                      prompt_median=args.prompt_median, response_median=args.response_median,
                      max_prompt_tokens=args.max_prompt_tokens,
                      max_response_tokens=args.max_response_tokens,
                      conversation_fraction=args.conversation_fraction,
                      failure_fraction=args.failure_fraction, seed=args.seed)
    n = write_trace(synth_rows(cfg), args.out, layout=args.layout)
    print(f"wrote {n} rows to {args.out}")
    return 0


def _schema(doc: Any) -> str:
    """What a summary file is, for the compare warning."""
    if isinstance(doc, dict) and isinstance(doc.get("schema"), str):
        return doc["schema"]
    if isinstance(doc, dict) and doc and all(
            isinstance(v, dict) and ("effective_capacity_rps" in v or "autoscale" in v)
            for v in doc.values()):
        return "a `pdserve sim` summary"
    return "not a pdserve summary"


def cmd_compare(args: argparse.Namespace) -> int:
    docs = []
    for path in (args.a, args.b):
        try:
            docs.append(json.loads(Path(path).read_text(encoding="utf-8")))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"{path}: {exc}") from exc
    kinds = [_schema(doc) for doc in docs]
    if kinds[0] != kinds[1] or RUN_SCHEMA not in kinds:
        print(f"warning: {args.a} is {kinds[0]} and {args.b} is {kinds[1]}: compare two "
              f"`pdserve bench replay` summaries ({RUN_SCHEMA}); cells either lacks are '-'",
              file=sys.stderr)
    print(compare_table(docs[0], docs[1], (Path(args.a).parent.name or args.a,
                                           Path(args.b).parent.name or args.b)), end="")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from bench.profile import profile

    info = server_info(args.url, args.model, api_key=args.api_key)
    synth = PromptSynthesizer(tokenizer_for(args, info), seed=args.seed)
    cfg = ClientConfig(url=args.url, model=info.model, timeout_s=args.timeout,
                       api_key=args.api_key)
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    asked = ints(args.prompt_lengths)
    lengths = [n for n in asked if not info.max_model_len or n + 1 < info.max_model_len]
    if len(lengths) < len(asked):
        print(f"profile: prompt lengths at or past the server's max_model_len "
              f"({info.max_model_len}) skipped", file=sys.stderr)
    if not lengths:
        raise SystemExit("no --prompt-lengths fits the server's max_model_len")
    doc = asyncio.run(profile(cfg, synth, prompt_lengths=lengths,
                              batch_sizes=ints(args.batch_sizes), repeats=args.repeats,
                              decode_tokens=args.decode_tokens))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, doc)
    print(json.dumps(doc, indent=2))
    return 0


# ---------------------------------------------------------------------------------------------
# Argument parsing


def _progress(args: argparse.Namespace) -> bool:
    return not args.no_progress and sys.stderr.isatty()


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, type=server_root,
                   help="an OpenAI-compatible server: its root (http://127.0.0.1:8000) or the "
                        ".../v1 URL `pdserve ready` prints")
    p.add_argument("--model", help="served model name (default: the first in /v1/models)")
    p.add_argument("--tokenizer", help="tokenizer dir or hub id (default: the server's model)")
    p.add_argument("--seed", type=int, default=0, help="seed of all prompt randomness")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request limit, seconds")


def _add_workload(p: argparse.ArgumentParser, trace_required: bool = True) -> None:
    _add_target(p)
    p.add_argument("--trace", required=trace_required,
                   help="BurstGPT-format CSV (either layout)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--start", type=float, default=0.0, help="window start, trace seconds")
    p.add_argument("--duration", type=float, help="window length, trace seconds")
    p.add_argument("--max-requests", type=int, help="stop after this many kept rows")
    p.add_argument("--trace-model", action="append",
                   help="keep rows of this trace Model (ChatGPT, GPT-4); repeatable")
    p.add_argument("--log-type", action="append",
                   help="keep rows of this Log Type ('Conversation log', 'API log'); repeatable")
    p.add_argument("--max-input-tokens", type=int, help="clamp request tokens")
    p.add_argument("--max-output-tokens", type=int, help="clamp response tokens")
    p.add_argument("--system-prompts", type=int, default=0,
                   help="distinct shared system prompts for API-log rows")
    p.add_argument("--system-prompt-tokens", type=int, default=0)
    p.add_argument("--no-sessions", action="store_true",
                   help="do not resend earlier turns of a session")
    p.add_argument("--no-ignore-eos", action="store_true")
    p.add_argument("--api-key", help="bearer token, if the endpoint needs one")
    shared.add_arguments(p, "bench")
    p.add_argument("--max-concurrency", type=int,
                   help="at most N requests in flight; a due request waits for a slot "
                        "(as `vllm bench serve --max-concurrency`)")
    p.add_argument("--percentiles", default=",".join(str(p) for p in PERCENTILES),
                   help="comma-separated percentiles for the vLLM-named keys (p99_ttft_ms...; "
                        "vLLM's --metric-percentiles); ours always include 50,90,99")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-plots", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve bench", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("replay", help="replay a trace open-loop and report")
    _add_workload(p, trace_required=False)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--time-scale", type=float, help="replay X times faster")
    g.add_argument("--rate", type=float, help="rescale to this mean rate (req/s)")
    p.add_argument("--synthetic", action="store_true",
                   help="no trace: --num-prompts requests of fixed --input-len/--output-len")
    p.add_argument("--num-prompts", type=int, help="--synthetic: requests (default 1000)")
    p.add_argument("--input-len", type=int, help="--synthetic: prompt tokens (default 1024)")
    p.add_argument("--output-len", type=int, help="--synthetic: output tokens (default 128)")
    p.add_argument("--request-rate", type=float,
                   help="--synthetic: Poisson arrivals per second (default inf: all at once)")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("sweep", help="find the highest rate meeting the SLOs")
    _add_workload(p)
    p.add_argument("--rates", required=True, help="comma-separated rates (req/s)")
    p.add_argument("--target", type=float, default=0.9, help="required SLO attainment")
    p.add_argument("--bisect-steps", type=int, default=4)
    p.set_defaults(func=cmd_sweep, time_scale=None, rate=None)

    p = sub.add_parser("synth", help="write a synthetic BurstGPT-format trace")
    d = SynthConfig()
    p.add_argument("--out", required=True, help="CSV file to write")
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds")
    p.add_argument("--rate", type=float, default=d.rate, help="mean req/s")
    p.add_argument("--dispersion", type=float, default=d.dispersion,
                   help="variance/mean of per-second counts (1 = Poisson)")
    p.add_argument("--prompt-median", type=float, default=d.prompt_median)
    p.add_argument("--response-median", type=float, default=d.response_median)
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    p.add_argument("--max-response-tokens", type=int, default=d.max_response_tokens)
    p.add_argument("--conversation-fraction", type=float, default=d.conversation_fraction)
    p.add_argument("--failure-fraction", type=float, default=d.failure_fraction)
    p.add_argument("--layout", choices=("v1", "v2"), default="v2",
                   help="v1: 6 columns; v2: with Session ID and Elapsed time")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("compare", help="side-by-side table of two summary.json files")
    p.add_argument("a")
    p.add_argument("b")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("profile", help="prefill s/token and decode step vs batch -> JSON")
    _add_target(p)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--prompt-lengths", default="32,128,512,1024,2048,3072",
                   help="prompt lengths of the prefill probes (those at or past the server's "
                        "max_model_len are skipped)")
    p.add_argument("--batch-sizes", default="1,2,4,8,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--api-key", help="bearer token, if the server needs one (a pdserve "
                                     "worker's: its vLLM API key)")
    p.set_defaults(func=cmd_profile)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``pdserve bench``."""
    args = build_parser().parse_args(argv)
    if args.command in ("replay", "sweep") and not shared.resolve_for_cli(args, "bench",
                                                                           "pdserve bench"):
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
