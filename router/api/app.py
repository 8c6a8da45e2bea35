"""The router's FastAPI app: OpenAI endpoints, health, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from kvtransfer.signing import Keyring, KeyringFile, keyring_source
from kvtransfer.signing import current as current_keyring
from router import heap
from router.api import first_token
from router.api.auth import ApiKeyMiddleware, ApiKeys, key_id, presented_key
from router.api.cache_salt import FIELD as CACHE_SALT
from router.api.cache_salt import KeySalts
from router.api.context import SCOPE_KEY, RequestIdMiddleware, new_request_id
from router.api.direct import DirectRoutes
from router.api.errors import error_response, install_error_handlers
from router.api.holds import Holds
from router.api.limits import LimitsMiddleware
from router.api.proxy import PDProxy
from router.api.redispatch import Redispatcher
from router.api.relay import RelayResponse, relay_body
from router.api.schemas import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    ChatCompletionRequest,
    CompletionRequest,
    Endpoint,
    completion_prompts,
    parse_json_body,
    requested_max_tokens,
    single_prompt,
    tokenize_model,
    validate_request,
    whole_request_reason,
)
from router.api.timeline import PhaseClock
from router.api.token_budget import Charge, TokenBudgets, settled_output
from router.api.tokenization import TokenizerCache, approximate_ids
from router.api.tracing import RequestTracer
from router.api.transport import UpstreamTransport
from router.api.untrusted import read_capped_body, refuse_worker_only_fields
from router.api.upstream import no_workers
from router.api.version import versions
from router.api.warm import Warmer
from router.config import RouterSettings
from router.errors import APIError, InvalidRequestError
from router.loop_lag import LoopLagProbe
from router.metrics import RouterMetrics
from router.placement import Placement
from router.policy.adaptive import FORCED_PATHS, AdaptivePaths, hold_limit_s
from router.policy.admission import AdmissionLimits, admit
from router.policy.base import CacheChanged, RouteRequest
from router.policy.context import PolicyContext
from router.policy.disagg import SelectiveDisaggregation
from router.policy.hashing import block_hashes, salt_seed
from router.policy.path_cost import PathCosts
from router.policy.paths import WHOLE_PATHS, whole_request_role
from router.state.cluster import ClusterSource, ClusterView
from router.state.load import LoadTracker
from router.state.registry import WorkerRecord, WorkerRegistry
from router.state.worker_load import WorkerLoadPoller

if TYPE_CHECKING:
    from router.state.kv_events import KVEventSubscriber

logger = logging.getLogger(__name__)


class RouterService:
    """Request handling shared by the endpoints; one per app (``app.state.router``)."""

    def __init__(self, settings: RouterSettings, cluster: ClusterSource, *,
                 on_tokenizer_loaded: Callable[[], object] = lambda: None) -> None:
        self.settings = settings
        self.cluster = cluster
        self.metrics = RouterMetrics()
        self.tokenizers = TokenizerCache(on_tokenizer_loaded)
        self.tracker = LoadTracker(settings.failure_cooldown_s)
        self.tracer = RequestTracer(settings.otlp_traces_endpoint)
        self.client: httpx.AsyncClient | None = None
        self.proxy: PDProxy | None = None
        self.redispatch: Redispatcher | None = None
        self.warmer: Warmer | None = None
        """Moves requests queued on busy workers to ones that would start them sooner."""
        self.loads: WorkerLoadPoller | None = None
        if settings.load_poll_interval_s > 0:
            self.loads = WorkerLoadPoller(
                cluster, lambda: self.client, self.tracker.in_flight,
                interval_s=settings.load_poll_interval_s,
                silent_after_s=settings.stall_timeout_s,
                on_failure=lambda role: self.metrics.load_scrape_failures.labels(role=role).inc())
        self.loop_lag = LoopLagProbe(self.metrics.loop_lag.observe)
        """Reports how late the event loop runs what is due (``router.loop_lag``)."""
        self.disagg = SelectiveDisaggregation(settings.disagg_min_prefill_tokens)
        context = PolicyContext(ttft_slo_s=settings.ttft_slo_s,
                                per_token_s=settings.prefill_s_per_token)
        costs = PathCosts.from_file(settings.path_costs_file) if settings.path_costs_file \
            else PathCosts()
        self.adaptive = AdaptivePaths(costs, settings.ttft_slo_s, settings.tpot_slo_s,
                                      block_tokens=context.block_tokens,
                                      defer=settings.hold_prefills,
                                      share_window_s=settings.adaptive_window_s)
        """The per-request path decision (``--path-policy``; adaptive disaggregation)."""
        self.placement = Placement.create(settings.policy, settings.decode_policy, context,
                                          self.tracker, decode_observers=(self.disagg.observe,))
        self.kv_events: KVEventSubscriber | None = None
        if settings.kv_events:  # imports zmq: only when asked for
            from router.state.kv_events import KVEventSubscriber

            self.kv_events = KVEventSubscriber(
                cluster, self._cache_changed,
                lambda kind: self.metrics.kv_events.labels(kind=kind).inc(),
                block_tokens=context.block_tokens, interval_s=settings.refresh_interval_s)
        self.limits = AdmissionLimits(settings.max_in_flight_per_worker,
                                      settings.admission_queue_slo_factor, settings.ttft_slo_s,
                                      settings.prefill_s_per_token)
        self.keyring = keyring_source(settings.cluster_secret, settings.cluster_secret_file)
        if self.keyring is None:
            logger.warning("no cluster secret (PDSERVE_CLUSTER_SECRET[_FILE]): kv_transfer_params "
                           "are sent unsigned; workers that require signatures refuse them")
        self.budgets = TokenBudgets(settings.prefill_tokens_per_min_per_key,
                                    settings.decode_tokens_per_min_per_key, time.monotonic)
        """Per-key token-rate limits (``router.api.token_budget``; off when both rates are 0)."""
        self._charges: dict[str, Charge] = {}
        """What each admitted request in flight was charged, by its upstream id."""
        self.holds = Holds()
        """Held adaptive plans wait here for the answers they would stall to end."""
        self.salts: KeySalts | None = None
        """Per-key ``cache_salt`` (``--cache-salt-per-key``; needs API keys)."""
        if settings.cache_salt_per_key:
            if settings.api_keys:
                self.salts = KeySalts(self.keyring)
            else:
                logger.warning("--cache-salt-per-key does nothing without --api-key: requests "
                               "present no key to salt by")

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=self.settings.max_upstream_connections,
                              max_keepalive_connections=100,
                              # below uvicorn's 5 s keep-alive, so we rarely reuse a connection
                              # the worker is closing at that moment
                              keepalive_expiry=3.0)
        # trust_env=False: workers are reached directly, never through an HTTP(S)_PROXY; the
        # wire is router.api.transport's (httpcore's costs more CPU than the rest of a relay)
        transport = UpstreamTransport(limits)
        self.client = httpx.AsyncClient(limits=limits, trust_env=False, transport=transport)
        self.proxy = PDProxy(self.settings, self.cluster, self.metrics, self.placement,
                             self.tracker, self.client,
                             self.loads.loads if self.loads is not None else dict,
                             on_done=self._timeline_done, keyring=self.keyring,
                             unresponsive=self.loads.unresponsive if self.loads is not None
                             else lambda worker_id: False, transport=transport)
        self.redispatch = Redispatcher(self.proxy, self.settings.redispatch_interval_s
                                       if self.loads is not None else 0.0,
                                       self.settings.prefill_s_per_token)
        self.warmer = Warmer(self.proxy, self.settings.warm_tokens)
        self.redispatch.start()  # joins: queued work moves first, then the warm requests
        self.warmer.start()
        await self.cluster.start()
        if self.loads is not None:
            self.loads.start()
        if self.kv_events is not None:
            self.kv_events.start()
        self.loop_lag.start()

    async def close(self) -> None:
        await self.loop_lag.close()
        if self.redispatch is not None:
            await self.redispatch.close()
        if self.warmer is not None:
            await self.warmer.close()
        if self.kv_events is not None:
            await self.kv_events.close()
        if self.loads is not None:
            await self.loads.close()
        await self.cluster.close()
        if self.proxy is not None:
            await self.proxy.unspent.close()
        if self.client is not None:
            await self.client.aclose()
        self.tracer.close()

    def _cache_changed(self, role: str, change: CacheChanged) -> None:
        """A worker's engine reported cache changes: its pool's policy learns them."""
        pool = self.placement.pools.get(role)
        if pool is not None:
            pool.tell(change)

    def _timeline_done(self, clock: PhaseClock, status: int) -> None:
        """A request ended: phase metrics, the timeline file, the trace; the adaptive decision
        stops counting it and, from a stream it planned, learns the engines' real costs; its
        key's decode budget is charged what it generated."""
        stall_s = self.adaptive.stall_added_s(clock.upstream_id)
        self.adaptive.finished(clock.upstream_id)
        self.holds.ended(clock.upstream_id)
        charge = self._charges.pop(clock.upstream_id, None)
        if charge is not None:
            self.budgets.settle(charge, settled_output(charge.decode, clock.output_tokens,
                                                       clock.output_events, status == 200))
        if clock.plan:  # what the learning below subtracts from the observed TPOT
            clock.plan["stall_added_s"] = round(stall_s, 6)
        if clock.plan and status == 200 and clock.first_output is not None:
            self.adaptive.learn(
                float(clock.plan["predicted_ttft_s"]),  # type: ignore[arg-type]
                clock.first_output - clock.mono["validated"],
                float(clock.plan["base_tpot_s"]),  # type: ignore[arg-type]
                None if clock.tpot_s is None else clock.tpot_s - stall_s,
                float(clock.plan.get("predicted_wait_s", 0.0)),  # type: ignore[arg-type]
                (float(clock.plan["prefill_scale"]),  # type: ignore[arg-type]
                 float(clock.plan["decode_scale"])))  # type: ignore[arg-type]
            self.metrics.path_cost_scale.labels(part="prefill").set(self.adaptive.prefill_scale)
            self.metrics.path_cost_scale.labels(part="decode").set(self.adaptive.decode_scale)
        for phase, seconds in clock.phases().items():
            self.metrics.phase.labels(phase=phase).observe(seconds)
        self.tracer.end(clock.span, clock, status)
        path = self.settings.timeline_file
        if path:
            try:
                with open(path, "a") as fh:
                    fh.write(json.dumps(clock.record()) + "\n")
            except OSError as exc:
                logger.warning("cannot append to timeline file %s: %s", path, exc)

    def _took(self, clock: PhaseClock, path: str, reason: str) -> None:
        """``clock``'s request takes ``path`` for ``reason`` (``pdserve_router_paths_total``)."""
        clock.path = path
        self.metrics.paths.labels(path=path, reason=reason).inc()

    def _adaptive_on(self, roles: Collection[str]) -> bool:
        """Whether the cost model picks paths (``--path-policy``; ``auto``: a flex worker is
        registered for the model)."""
        policy = self.settings.path_policy
        return policy != "static" and (policy != "auto" or "flex" in roles)

    def _admit(self, model: str, whole: str | None) -> None:
        """429 with ``Retry-After`` when a pool the request needs is full (policy.admission):
        prefill and decode, or the one pool that serves it whole (``whole``)."""
        assert self.proxy is not None
        pools = (("prefill", True), ("decode", False)) if whole is None else \
            ((whole, whole != "decode"),)
        for role, prefill in pools:
            verdict = admit(self.proxy.pool(role, model), self.limits, prefill=prefill)
            if not verdict.admit:
                self.metrics.rejected.labels(pool=role).inc()
                raise APIError(f"the {role} pool is overloaded ({verdict.reason}); retry after "
                               f"{verdict.retry_after_s} s", status=429, code="server_overloaded",
                               type="rate_limit_error",
                               headers={"Retry-After": str(verdict.retry_after_s)})

    def _output_cost(self, req: Any) -> int:
        """Output tokens a request may generate, as its key's decode budget is charged at
        admission: its cap (or the expected output) per choice and per prompt."""
        prompts = len(completion_prompts(req)) if isinstance(req, CompletionRequest) else 1
        cap = requested_max_tokens(req) or self.settings.expected_output_tokens
        return cap * (req.n or 1) * prompts

    def _charge(self, clock: PhaseClock, incoming: dict[str, str], prompt_tokens: int,
                output_tokens: int) -> None:
        """Charge the request's key its tokens (``router.api.token_budget``), or 429 with
        ``Retry-After`` before anything is routed when its budget lacks them."""
        key = key_id(incoming.get("authorization")) if self.settings.api_keys else ""
        verdict = self.budgets.admit(key, prompt_tokens, output_tokens)
        if isinstance(verdict, Charge):
            self._charges[clock.upstream_id] = verdict
            return
        self.metrics.limited.labels(reason=verdict.kind).inc()
        what = "prompt" if verdict.kind == "prefill_tokens" else "output"
        raise APIError(f"this API key may use {verdict.per_min} {what} tokens per minute; this "
                       f"request needs {verdict.cost}: retry after {verdict.retry_after_s} s",
                       status=429, code="token_rate_limit_exceeded", type="rate_limit_error",
                       headers={"Retry-After": str(verdict.retry_after_s)})

    async def _check_context(self, req: Any, records: list[WorkerRecord],
                             body: dict[str, Any]) -> tuple[tuple[int, ...], int]:
        """The placed prompt's token ids and the tokens of every prompt (empty and 0 when not
        computable); 400 when prompt + output > context."""
        ref = records[0]
        max_model_len = min(r.max_model_len for r in records)
        if isinstance(req, ChatCompletionRequest):
            messages = [m.model_dump() for m in req.messages]
            each = [await self.tokenizers.count_chat(ref.model_path, messages, body)]
        else:
            assert isinstance(req, CompletionRequest)
            each = await self.tokenizers.count_completions(ref.model_path,
                                                           completion_prompts(req))
        counted = [e for e in each if e is not None]
        if len(counted) != len(each):
            return (), 0
        # the longest prompt of a batch bounds the checks; the first is the one placed
        routed, ids = counted[0], max(counted, key=len)
        max_tokens = requested_max_tokens(req)
        limit = self.settings.max_output_tokens
        if limit and max_tokens is not None and max_tokens > limit:
            raise InvalidRequestError(f"max_tokens {max_tokens} exceeds this server's limit of "
                                      f"{limit}", code="max_tokens_too_large", param="max_tokens")
        limit = self.settings.max_prompt_tokens
        if limit and len(ids) > limit:
            raise InvalidRequestError(f"the prompt has {len(ids)} tokens, more than this "
                                      f"server's limit of {limit}", code="prompt_too_long",
                                      param="messages" if isinstance(req, ChatCompletionRequest)
                                      else "prompt")
        # The prefill itself generates one token, so even without max_tokens one must fit.
        needed = len(ids) + (max_tokens if max_tokens is not None else 1)
        if needed > max_model_len:
            out = f"{max_tokens} in the completion" if max_tokens is not None else \
                "at least 1 in the completion"
            raise InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {needed} tokens ({len(ids)} in the prompt, {out}). Please reduce the "
                "length of the prompt or the completion.",
                code="context_length_exceeded",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt")
        return tuple(routed), sum(len(e) for e in counted)

    async def handle(self, endpoint: Endpoint, request: Request) -> Response:
        clock = PhaseClock.start(request.scope.get(SCOPE_KEY) or new_request_id())
        incoming = {k.lower(): v for k, v in request.headers.items()}
        clock.span = self.tracer.begin(clock, endpoint.name, incoming)
        try:
            if self.settings.request_timeout_s > 0:
                try:
                    async with asyncio.timeout(self.settings.request_timeout_s):
                        response = await self._handle(endpoint, request, incoming, clock)
                except TimeoutError:
                    raise APIError(f"the answer did not start within the router's "
                                   f"{self.settings.request_timeout_s:g} s deadline",
                                   status=504, code="deadline_exceeded",
                                   type="timeout_error") from None
            else:
                response = await self._handle(endpoint, request, incoming, clock)
        except asyncio.CancelledError:  # the answer deadline or the server stopped it
            self._charges.pop(clock.upstream_id, None)  # charged as admitted, not tracked
            raise
        except APIError as err:
            if err.status >= 500:
                logger.warning("request failed: %s", err.message)
            else:
                logger.info("request rejected (%s): %s", err.code, err.message)
            response = error_response(err)
        except Exception:
            logger.exception("unexpected error while handling the request")
            response = error_response(APIError("internal router error", status=500,
                                               code="internal_error", type="server_error"))
        if not isinstance(response, RelayResponse):  # streams account when they end
            clock.mark("done")
            self.metrics.requests.labels(endpoint=endpoint.name,
                                         status=str(response.status_code),
                                         model_name=clock.model).inc()
            self.metrics.request_duration.labels(endpoint=endpoint.name,
                                                 model_name=clock.model).observe(
                clock.mono["done"] - clock.started)
            self._timeline_done(clock, response.status_code)
        return response

    async def _handle(self, endpoint: Endpoint, request: Request, incoming: dict[str, str],
                      clock: PhaseClock) -> Response:
        raw = await read_capped_body(request, self.settings.max_body_bytes,
                                     self.settings.body_timeout_s)
        body = parse_json_body(raw)
        refuse_worker_only_fields(body)
        req = validate_request(endpoint, body)
        if self.salts is not None:  # before any use of the body: every call carries the salt
            self.salts.apply(body, presented_key(incoming.get("authorization")))
        records = self.cluster.workers(model=req.model)
        if not records:
            raise model_not_found(req.model)
        clock.model = req.model  # a registered model: a bounded metric label
        roles = {r.role for r in records}
        pd_ok = {"prefill", "decode"} <= roles
        whole = None if pd_ok else whole_request_role(roles)
        if whole in ("prefill", "decode") and not self.settings.role_fallback:
            raise no_workers("decode" if whole == "prefill" else "prefill", req.model)
        shape = whole_request_reason(req)  # n > 1 or a batch: one worker serves it whole
        adaptive = self._adaptive_on(roles) and shape is None
        if adaptive:  # the cost model plans whole or P/D among every engine
            whole = None
        if whole is None and shape is not None:
            whole = whole_request_role(roles - {"prefill"})
        token_ids, prompt_tokens = await self._check_context(req, records, body)
        tokenized = bool(token_ids)
        if not token_ids:  # no tokenizer on this host: place by the text itself
            self.metrics.tokenizer_fallbacks.inc()
            token_ids = approximate_ids(_prompt_text(req))
            prompt_tokens = _approximate_prompt_tokens(req)
        self.metrics.requests_received.labels(endpoint=endpoint.name, model_name=req.model).inc()
        self._admit(req.model, "flex" if adaptive and "flex" in roles else whole)
        if self.budgets.enabled:
            self._charge(clock, incoming, prompt_tokens, self._output_cost(req))
        # hashed once here; prefix-aware policies and the load accounting reuse the blocks;
        # under the salt the workers get, as vLLM hashes them
        route = RouteRequest(request_id=clock.upstream_id, model=req.model,
                             prompt_token_ids=token_ids,
                             block_hashes=block_hashes(token_ids,
                                                       seed=salt_seed(body.get(CACHE_SALT))))
        if tokenized and self.warmer is not None and not body.get(CACHE_SALT):
            self.warmer.saw(route)  # a prompt a worker that joins may be warmed with
        clock.mark("validated")
        assert self.proxy is not None, "RouterService.start() was not awaited"
        stream = bool(req.stream)
        if whole is not None:  # no P/D pair, or a shape P/D does not split: served whole
            path, reason = WHOLE_PATHS[whole]
            self._took(clock, path, shape or reason)
            return await self.proxy.decode(endpoint, body, None, route, incoming, stream=stream,
                                           clock=clock, role=whole)
        if adaptive:
            return await self._adaptive(endpoint, body, req, route, incoming, clock, stream)
        if self.disagg.enabled:
            target = self.proxy.peek_decode(route)
            choice = self.disagg.decide(route, target.worker_id) if target else None
            if choice is not None and choice.path == "decode_only":
                self._took(clock, "decode_only", choice.reason)
                return await self.proxy.decode(endpoint, body, None, route, incoming,
                                               stream=stream, clock=clock, first_choice=target)
        return await self._pd(endpoint, body, route, incoming, clock, stream)

    async def _adaptive(self, endpoint: Endpoint, body: dict[str, Any], req: Any,
                        route: RouteRequest, incoming: dict[str, str], clock: PhaseClock,
                        stream: bool) -> Response:
        """Plan the request's path with the cost model (``router.policy.adaptive``) over every
        live engine of the model, then run it: whole on one worker, or P/D on the pair."""
        assert self.proxy is not None
        records = self.cluster.workers(model=route.model)
        by_id = {r.worker_id: r for r in records}
        candidates = self.tracker.candidates(records, self.proxy.reported_loads())
        now = time.monotonic()
        engines = self.adaptive.loads(
            route, [(by_id[c.worker_id].role, c) for c in candidates], now)
        output_tokens = requested_max_tokens(req) or self.settings.expected_output_tokens
        force = self.settings.path_policy if self.settings.path_policy in FORCED_PATHS else None
        decision = self.adaptive.decide(route, output_tokens, engines, force)
        if decision is None:
            raise APIError(f"no live worker for model '{route.model}'", status=503,
                           code="no_workers", type="server_error")
        plan = decision.plan
        self.adaptive.dispatched(route, plan, output_tokens, now, sensitive=decision.sensitive)
        clock.plan = {"path": plan.path, "reason": decision.reason, "worker": plan.worker,
                      "prefill_worker": plan.prefill_worker,
                      "predicted_ttft_s": round(plan.ttft_s, 6),
                      "predicted_tpot_s": round(plan.tpot_s, 6),
                      "base_tpot_s": round(plan.tpot_base_s, 6),
                      "predicted_admitted_tpot_s": round(plan.harm_tpot_s, 6),
                      "predicted_wait_s": round(
                          plan.ttft_s - self.adaptive.costs.prefill_s(plan.uncached_tokens), 6),
                      "prefill_scale": round(self.adaptive.prefill_scale, 4),
                      "decode_scale": round(self.adaptive.decode_scale, 4),
                      "hold_s": round(plan.hold_s, 6)}
        upstream_id = clock.upstream_id
        clock.on_prefilled = lambda: self.adaptive.prefilled(upstream_id, time.monotonic())
        if plan.waits_for:  # its prefill waits for the answers it would stall to end
            limit_s = hold_limit_s(plan, self.settings.ttft_slo_s)
            clock.plan["held_s"] = round(await self.holds.wait(plan.waits_for, limit_s), 6)
            self.adaptive.released(upstream_id, time.monotonic())
        worker = by_id[plan.worker]
        if plan.path == "whole":
            self._took(clock, "whole", decision.reason)
            return await self.proxy.decode(endpoint, body, None, route, incoming, stream=stream,
                                           clock=clock, role=worker.role, first_choice=worker)
        assert plan.prefill_worker is not None
        return await self._pd(endpoint, body, route, incoming, clock, stream,
                              reason=decision.reason, prefill=by_id[plan.prefill_worker],
                              decode=worker)

    async def _pd(self, endpoint: Endpoint, body: dict[str, Any], route: RouteRequest,
                  incoming: dict[str, str], clock: PhaseClock, stream: bool, *,
                  reason: str | None = None, prefill: WorkerRecord | None = None,
                  decode: WorkerRecord | None = None) -> Response:
        """Prefill then decode (the prefill's first token streamed at once when it can be);
        ``prefill``/``decode``: workers already chosen for the first attempts; ``reason``: the
        path's reason label when a decision chose P/D (else how the first token was served)."""
        assert self.proxy is not None
        model = route.model
        continue_from_prefill = self.settings.first_token_from_prefill and \
            first_token.eligible(endpoint, body)
        try:
            result = await self.proxy.prefill(endpoint, body, route, incoming, clock,
                                              token_ids=continue_from_prefill,
                                              first_choice=prefill)
        except APIError as err:
            if err.status < 500 or not self.settings.role_fallback or not (
                    self.cluster.workers("decode", model) or self.cluster.workers("flex", model)):
                raise
            # Every prefill failed (or none is left): a decode worker is a complete vLLM and
            # computes the prompt itself; nothing was leased, so nothing can be stranded.
            logger.warning("prefill failed (%s); the request is served whole by a decode worker",
                           err.message)
            self._took(clock, "decode_only", "prefill_failed")
            return await self.proxy.decode(endpoint, body, None, route, incoming,
                                           stream=stream, clock=clock, first_choice=decode)
        if isinstance(result, Response):
            return result
        if isinstance(result, WorkerRecord):  # mixed fleet: the policy chose a plain worker
            self._took(clock, "aggregated", "aggregated_worker")
            return await self.proxy.decode(endpoint, body, None, route, incoming, stream=stream,
                                           clock=clock, role="aggregated", first_choice=result)
        kv_params, prefill_worker, answer = result
        logger.debug("prefill done on %s", prefill_worker.worker_id)
        first = first_token.parse_prefill(answer) if continue_from_prefill else None
        if first is not None:
            self._took(clock, "pd_first_token", reason or "eligible")
            return self.proxy.continue_stream(endpoint, body, first, kv_params, route, incoming,
                                              clock, first_choice=decode)
        self._took(clock, "pd", reason or ("prefill_token_unusable" if continue_from_prefill
                                           else "not_eligible"))
        return await self.proxy.decode(endpoint, body, kv_params, route, incoming,
                                       stream=stream, clock=clock, first_choice=decode)

    def health(self) -> JSONResponse:
        prefill = len(self.cluster.workers("prefill"))
        decode = len(self.cluster.workers("decode"))
        aggregated = len(self.cluster.workers("aggregated"))
        flex = len(self.cluster.workers("flex"))
        self.metrics.workers.labels(role="prefill").set(prefill)
        self.metrics.workers.labels(role="decode").set(decode)
        self.metrics.workers.labels(role="aggregated").set(aggregated)
        self.metrics.workers.labels(role="flex").set(flex)
        ok = (prefill > 0 and decode > 0) or aggregated > 0 or flex > 0
        # ready means a request is answered at full speed: every served model's tokenizer is
        # loaded (the first request would otherwise wait 1-4 s for it in validation)
        warming = sorted({r.model_path for r in self.cluster.workers()
                          if not self.tokenizers.warm(r.model_path)})
        status = "warming" if ok and warming else "ok" if ok else "unavailable"
        ok = ok and not warming
        body = {"status": status, "prefill_workers": prefill,
                "decode_workers": decode, "aggregated_workers": aggregated,
                "flex_workers": flex,
                "redis": "ok" if self.cluster.redis_ok else "unreachable"}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def workers(self, prompt: str | None = None) -> dict[str, Any]:
        """Every routable worker with the load the placement policies see (``GET /workers``):
        this router's accounting merged with the worker's own last report. With ``prompt`` (a
        completion prompt, ``GET /workers?prompt=...``), each prefill or aggregated worker also
        says how many of its tokens the router's cache model expects it to have cached."""
        reported = self.loads.loads() if self.loads is not None else {}
        records = self.cluster.workers()
        cached: dict[str, int] = {}
        if prompt is not None:
            cached = await self._cached_prompt_tokens(records, prompt)
        now = time.monotonic()
        data = []
        for r, c in zip(records, self.tracker.candidates(records, reported), strict=True):
            load = reported.get(r.worker_id)
            data.append({
                "worker_id": r.worker_id, "role": r.role, "model": r.model, "url": r.http_url,
                "in_flight": c.in_flight, "running": c.running,
                "pending_prefill_tokens": c.pending_prefill_tokens, "kv_usage": c.kv_usage,
                "recently_failed": c.recently_failed,
                **({} if self.kv_events is None else
                   {"kv_events": self.kv_events.stats(r.worker_id)}),
                **({"cached_prompt_tokens": cached[r.worker_id]} if r.worker_id in cached
                   else {}),
                "reported": None if load is None else {
                    "running": load.running, "waiting": load.waiting,
                    "kv_usage": load.kv_usage, "age_s": round(now - load.scraped_at_s, 3)},
            })
        return {"object": "list", "data": data}

    async def _cached_prompt_tokens(self, records: list[WorkerRecord], prompt: str
                                    ) -> dict[str, int]:
        """worker id -> tokens of ``prompt`` its pool's policy expects it to have cached
        (``prompt`` sent without a ``cache_salt``: under ``--cache-salt-per-key`` no keyed
        request's blocks match it)."""
        out: dict[str, int] = {}
        for r in records:
            pool = self.placement.pools.get(r.role)
            if pool is None or not pool.prefill:
                continue
            ids = await self.tokenizers.count_completion(r.model_path, prompt)
            if ids is None:
                continue
            route = RouteRequest(request_id="", model=r.model, prompt_token_ids=tuple(ids),
                                 block_hashes=block_hashes(ids))
            out[r.worker_id] = pool.cached_tokens(route, r.worker_id)
        return out

    async def forward(self, path: str, request: Request) -> Response:
        """``/tokenize`` and ``/detokenize``: answered by the least busy worker serving the
        body's ``model`` (vLLM's own endpoints, so ids match what the engine computes)."""
        try:
            raw = await read_capped_body(request, self.settings.max_body_bytes,
                                         self.settings.body_timeout_s)
            body = parse_json_body(raw)
        except APIError as err:
            return error_response(err)
        try:
            model = tokenize_model(body.get("model"), self.cluster.models())
        except APIError as err:
            return error_response(err)
        records = self.cluster.workers(model=model)
        if not records:
            return error_response(model_not_found(model))
        worker = min(records, key=lambda r: self.tracker.in_flight(r.worker_id))
        assert self.client is not None
        try:
            resp = await self.client.post(worker.http_url + path, content=raw, timeout=30.0,
                                          headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:
            return error_response(APIError(f"worker {worker.worker_id} failed: {exc!r}",
                                           status=502, code="upstream_error",
                                           type="upstream_error"))
        if resp.status_code >= 500:
            return error_response(APIError(f"worker {worker.worker_id} answered "
                                           f"{resp.status_code}", status=502,
                                           code="upstream_error", type="upstream_error"))
        return relay_body(resp.content, resp.status_code, resp.headers.get("content-type"))

    def models(self) -> dict[str, Any]:
        data = []
        for model in self.cluster.models():
            records = self.cluster.workers(model=model)
            data.append({
                "id": model,
                "object": "model",
                "created": int(min(r.started_at for r in records)),
                "owned_by": "pdserve",
                "root": records[0].model_path,
                "max_model_len": min(r.max_model_len for r in records),
            })
        return {"object": "list", "data": data}


def model_not_found(model: object) -> InvalidRequestError:
    """OpenAI's 404 for a model no live worker serves."""
    return InvalidRequestError(f"The model '{model}' does not exist.", code="model_not_found",
                               param="model", status=404)


def _prompt_text(req: Any) -> str:
    """The prompt as text, for placement when it cannot be tokenized here."""
    if isinstance(req, ChatCompletionRequest):
        return json.dumps([m.model_dump() for m in req.messages], sort_keys=True, default=str)
    prompt = single_prompt(req)
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def _approximate_prompt_tokens(req: Any) -> int:
    """Every prompt's length in stand-in tokens (``approximate_ids``) when the router cannot
    tokenize them: what the key's prefill budget is charged."""
    if isinstance(req, CompletionRequest):
        return sum(len(p) if isinstance(p, list) else len(approximate_ids(p))
                   for p in completion_prompts(req))
    return len(approximate_ids(_prompt_text(req)))


def _signed_by(source: KeyringFile | Keyring) -> Callable[[WorkerRecord], bool]:
    """Trusts the registrations signed with the keyring ``source`` holds now."""
    def trusted(record: WorkerRecord) -> bool:
        keyring = current_keyring(source)
        return keyring is not None and record.verified(keyring)
    return trusted


def create_app(settings: RouterSettings, *, cluster: ClusterSource | None = None,
               settle_heap: bool = False) -> FastAPI:
    """Build the router app. Without ``cluster`` it reads membership from ``settings.redis_url``.
    The app starts and closes the cluster view in its lifespan. ``settle_heap`` (the router's
    own process, ``router.main``): freeze the heap after start-up and after each tokenizer
    load (``router.heap``), so the collector's full passes stop holding the event loop."""
    if cluster is None:
        # with a keyring, only registrations signed with the cluster secret are members:
        # Redis access alone cannot put a worker in front of the router's requests
        source = keyring_source(settings.cluster_secret, settings.cluster_secret_file)
        trust = None if source is None else _signed_by(source)
        registry = WorkerRegistry(settings.redis_url, prefix=settings.redis_prefix, trust=trust)
        cluster = ClusterView(registry, refresh_interval_s=settings.refresh_interval_s)

    def settle() -> None:
        service.metrics.heap_frozen.set(heap.settle())

    service = RouterService(settings, cluster,
                            on_tokenizer_loaded=settle if settle_heap else lambda: None)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.start()
        if settle_heap:
            settle()
        logger.info("router ready (policy=%s, decode_policy=%s)", settings.policy,
                    settings.decode_policy)
        try:
            yield
        finally:
            await service.close()

    app = FastAPI(title="pdserve router", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.router = service
    install_error_handlers(app)
    # innermost user middleware: keys, limits and the request id still apply to these
    app.add_middleware(DirectRoutes, routes={
        COMPLETIONS.path: lambda request: service.handle(COMPLETIONS, request),
        CHAT_COMPLETIONS.path: lambda request: service.handle(CHAT_COMPLETIONS, request)})
    if settings.max_concurrent_per_key > 0 or settings.answer_deadline_s > 0:
        # inside the key check: only authenticated requests count against a key
        app.add_middleware(LimitsMiddleware, max_concurrent=settings.max_concurrent_per_key,
                           deadline_s=settings.answer_deadline_s,
                           on_refused=lambda reason: service.metrics.limited.labels(
                               reason=reason).inc(), keyed=bool(settings.api_keys))
    if settings.api_keys:
        admin = ApiKeys(settings.admin_api_keys) if settings.admin_api_keys else None
        app.add_middleware(ApiKeyMiddleware, keys=ApiKeys(settings.api_keys), admin=admin)
    app.add_middleware(RequestIdMiddleware)  # outermost: 401s carry x-request-id too

    @app.post("/v1/completions")  # answered by DirectRoutes; kept for the routing table
    async def completions(request: Request) -> Response:
        return await service.handle(COMPLETIONS, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await service.handle(CHAT_COMPLETIONS, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return service.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        for entry in service.models()["data"]:
            if entry["id"] == model_id:
                return JSONResponse(entry)
        return error_response(model_not_found(model_id))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await service.forward("/tokenize", request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await service.forward("/detokenize", request)

    @app.get("/workers")
    async def workers(prompt: str | None = None) -> dict[str, Any]:
        return await service.workers(prompt)

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return versions()

    @app.get("/health")
    async def health() -> JSONResponse:
        return service.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=service.metrics.content_type)

    return app
