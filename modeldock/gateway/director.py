"""The gateway's domain state and the director that routes one request through it.

Plain typed Python, no gRPC and no protobuf: `extproc/flow.py` translates Envoy's
messages into `Gateway.route(head, body)` / `Gateway.models(head)` and the answer
back. The ADS client feeds endpoints and staleness in (`on_endpoints`, `on_status`).

`route` runs every step of a completion request, in this order, each once:

  1. route check     path and method (404 / 400)
  2. authenticate    one Bearer key -> tenant (401)
  3. length          body size against `limits.max_body_bytes` (413)
  4. parse           JSON object with a valid `model`, `stream` a boolean (400)
  5. resolve model   known and allowed for the tenant (one 404 for both); alias rewrite
  6. dispatchable    snapshot fresh and endpoints present, the model's upstream credential
                     readable (503), before admission so a request that cannot be served
                     keeps the tenant's rate-limit quota
  7. prompt blocks   the prompt's block hashes, for prefix affinity; the queue class
                     (`x-priority`, 400 if the tenant may not use it); the output bound, read once as
                     the backend reads it (`read_output_limit`: max_tokens, n, best_of, prompt lists; 400
                     naming a field it cannot count)
  8. admission       in-flight slot and rate-limit windows (429 / 503)
  8b. token budgets  reserve the prompt estimate and the output bound in every budget that applies
                     (429 / 503), and write the reserved output limit into the body when the client
                     set none or the budget had less (billing.bound_output); the token cost for the
                     queue and the picker follows from that limit; a streaming request that needs usage
                     asks the backend for it (`stream_options.include_usage`, dropped again by Envoy if
                     the client did not ask)
  9. pick + count    `Picker.pick(model, prefix, cost=...)`, synchronous, right after
                     admission; when every endpoint is saturated (or others already wait),
                     the request waits in the model's flow-control queue holding its ticket
                     and reservation, and is picked and counted in one synchronous step inside
                     the queue's claim callback when room appears (a lease of the model released,
                     a fresh sample: the picker's room listener). It leaves with 429 queue_full /
                     queue_timeout, or at once when its client goes (ticket released, tokens refunded).

A reservation is refunded at once if the request is refused after it (pick, queue); otherwise it
is settled once, from Envoy's access log, by `Gateway.settle` (settlement.py joins the two).

Where later features go:
  - an Endpoint-Picker protocol adapter (GIE's EPP): a second adapter beside extproc/flow.py
    that calls the same `route` and renders `Routed` in its own protocol.

Every refusal is a `modeldock.errors.Rejection`, logged here with the request id and
the tenant and model when known; the adapter renders it (extproc/responses.py).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TypedDict, cast

from modeldock.admission.budget_headers import OUTPUT_LIMIT, OUTPUT_LIMIT_REASON
from modeldock.admission.budgets import Reservation, TokenBudgets, has_budgets
from modeldock.admission.keys import KeyStore
from modeldock.admission.limits import Admission
from modeldock.admission.pricing import Price, model_price
from modeldock.admission.tokens import BYTES_PER_TOKEN, Usage
from modeldock.clock import Clock
from modeldock.config import Config, ModelConfig, TenantConfig
from modeldock.errors import BadRequest, NotFound, Rejection, Unavailable
from modeldock.flowcontrol import FlowQueues, Item, QueueMetrics, estimate_cost
from modeldock.flowcontrol.cost import OutputLimit, read_output_limit
from modeldock.flowcontrol.standing import Standing
from modeldock.gateway.billing import Bound, bound_output, termination
from modeldock.gateway.credentials import UpstreamCredential
from modeldock.gateway.request import PRIORITY_HEADER, RequestHead, bearer_key, check_length, parse_body
from modeldock.gateway.routed import Finished, Routed, ask_for_usage
from modeldock.gateway.settlement import UsageReport
from modeldock.picking import Pick, Picker, Saturated
from modeldock.picking.prefix import prompt_blocks
from modeldock.types import Endpoint
from modeldock.usage.log import UsageLog
from modeldock.usage.record import TokenSource, UsageRecord, new_request_id
from modeldock.xds.resources import cluster_name

log = logging.getLogger("modeldock.extproc")

CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATHS = frozenset({CHAT_PATH, "/v1/completions"})
MODELS_PATH = "/v1/models"
# The drain budget applies once the oldest request queued has waited this share of
# queue.max_wait_seconds: evidence that the queue is not a burst that drains at once (its
# estimate counts each request's whole output limit, which real requests often stop short of).
# A whole max_wait let admitted requests wait up to twice it (overload TTFT p95 0.81-0.94 s
# against 0.76-0.79 s at a half, three runs and two; measured at 0.6x capacity, none shed).
SHED_AFTER = 0.5
# OpenAI's wording, for an unknown model and for one the key may not use alike.
_NO_SUCH_MODEL = "The model `{}` does not exist or you do not have access to it."


# What a queued request carries for its pick: prompt blocks, token cost, the gateway's subset hint,
# and its standing's inputs: tenant id, weight, class priority.
_Waiting = tuple[Sequence[int], int, frozenset[Endpoint] | None, str, float, int, int | None]


class _Headroom(TypedDict, total=False):
    headroom: int
    headroom_tokens: int | None


def _release_pick(pick: Pick) -> None:
    """A pick the queue made for a waiter that was cancelled in the same instant."""
    pick.lease.release()


def check_route(head: RequestHead) -> None:
    """A completion path, asked with POST."""
    if head.path not in COMPLETION_PATHS:
        raise NotFound(f"Unknown path {head.path!r}.", code="unknown_url")
    if head.method != "POST":
        raise BadRequest(f"Use POST for {head.path}.", code="method_not_allowed")


class Gateway:
    def __init__(
        self,
        config: Config,
        clock: Clock,
        picker: Picker,
        admission: Admission,
        *,
        xds_down_for: Callable[[], float] = lambda: 0.0,
        queue_metrics: QueueMetrics | None = None,
        budgets: TokenBudgets | None = None,
        usage_log: UsageLog | None = None,
    ) -> None:
        self.clock = clock
        self.picker = picker
        self.admission = admission
        self.budgets = budgets if budgets is not None else TokenBudgets(config, clock)
        # Usage records on: every routed request needs its usage, budget or not.
        self.usage_log = usage_log
        self.records_on = usage_log is not None and usage_log.sink is not None
        self._route_ids = itertools.count(1)  # reservation keys when the caller gives no request key
        self._xds_down_for = xds_down_for
        self.stale_models: frozenset[str] = frozenset()
        # The queue's settings apply from start; tenants' weights and classes follow reloads.
        self.queues: FlowQueues[Pick] = FlowQueues(config.queue, clock, release=_release_pick, metrics=queue_metrics)
        self.standing = Standing(clock, config.queue.headroom_window_seconds, config.queue.share_window_seconds)
        self._dispatching = False
        self._again: set[str] = set()
        picker.add_room_listener(self.dispatch)
        self._load(config)

    def apply_config(self, config: Config) -> None:
        """Swap tenants, models and limits on reload."""
        self.admission.reconfigure(config)
        if config.queue != self.queues.config:
            log.warning("config reload: `queue:` changed; restart ext_proc "
                        "(and re-render Envoy's bootstrap) to apply it")
        self.budgets.reconfigure(config)
        self._load(config)

    def _load(self, config: Config) -> None:
        self.config = config
        self.keys = KeyStore(config.tenants)
        self._models = {m.name: m for m in config.models}
        self.stale_after = config.discovery.stale_after_seconds
        self.max_body_bytes = config.limits.max_body_bytes
        # Env values are read here, on every (re)load; files when they change (credentials.py).
        self._credentials = {m.name: UpstreamCredential(m.upstream_auth, self.clock)
                             for m in config.models if m.upstream_auth is not None}
        self._prices: dict[str, Price] = {m.name: price for m in config.models
                                          if (price := model_price(m)) is not None}

    # -- fed by the ADS client -------------------------------------------

    def on_endpoints(self, model: str, endpoints: tuple[Endpoint, ...]) -> None:
        config = self._models.get(model)
        # vLLM labels its metrics with the name it serves, which an alias may hide.
        self.picker.set_endpoints(model, endpoints, served_name=config.upstream_name if config else None,
                                  max_num_seqs=config.max_num_seqs if config else None)

    def on_status(self, stale_models: frozenset[str]) -> None:
        self.stale_models = stale_models

    # -- the director ----------------------------------------------------

    async def route(self, head: RequestHead, body: bytes, rid: str = "", *,
                    subset: frozenset[Endpoint] | None = None) -> Routed:
        """Steps 1-9 of the module docstring; raises a Rejection, holding nothing, when one refuses.
        `rid` is the caller's key for the request (modeldock:rid), which its reservation is held under;
        `subset`: only these endpoints may serve it (a gateway's hint, modeldock/epp/)."""
        tenant: TenantConfig | None = None
        model: str | None = None
        resolved = ""  # the model's configured name once resolve_model took it (a bounded metric label)
        try:
            check_route(head)
            tenant = self.keys.authenticate(bearer_key(head.authorization))
            check_length(len(body), self.max_body_bytes)
            data = parse_body(body)
            model = str(data["model"])
            config = self.resolve_model(tenant, model)
            resolved = config.name
            rewrite = config.upstream_name != model
            if rewrite:
                data["model"] = config.upstream_name
            self.check_dispatchable(model, subset)
            upstream_auth = self.upstream_auth(model)
            prefix = prompt_blocks(data)
            klass = self.request_class(tenant, head)
            chat = head.path == CHAT_PATH
            limit, normalised = read_output_limit(data, chat=chat)
            ticket = await self.admission.admit(tenant, model)
            reservation: Reservation | None = None
            bound = Bound(limit.per_choice, "")
            try:
                if self.records_on or has_budgets(tenant):
                    reservation = await self.budgets.reserve(
                        tenant, config.upstream_name, rid or f"route-{next(self._route_ids)}",
                        prompt=-(-len(body) // BYTES_PER_TOKEN),
                        output=limit.tokens(self.config.limits.reserve_completion_tokens),
                        min_output=limit.choices, price=self._prices.get(model))
                    # The body's output limit is never above what was reserved for it.
                    bound = bound_output(data, limit, reservation.output, capped=reservation.capped, chat=chat)
            except BaseException:
                ticket.release()
                raise
            estimate = estimate_cost(data, self.queues.config.default_max_tokens,
                                     limit=OutputLimit(bound.per_choice, limit.choices))
            cost, output = estimate.total, estimate.max_new_tokens
            try:
                pick = await self._pick(head, tenant, model, klass, prefix, cost, subset, output)
            except BaseException:
                ticket.release()  # timed out, shed, cancelled (the client left) or refused: nothing held
                if reservation is not None:
                    reservation.refund_nowait()  # refused after the reservation: give it all back
                raise
        except Rejection as rejection:
            self._log_rejection(head, rejection, tenant, model)
            rejection.tenant, rejection.model = tenant.id if tenant else "", resolved
            if tenant is not None:
                self._record_rejection(head, rejection, rid, tenant, resolved)
            raise
        wants_usage = self.records_on or (reservation is not None and reservation.counted)
        drop_usage = wants_usage and ask_for_usage(data)
        rewritten = rewrite or drop_usage or normalised or bool(bound.reason)
        new_body = json.dumps(data, separators=(",", ":")).encode() if rewritten else None
        metadata: Mapping[str, str] = ticket.headers
        if reservation is not None and (reservation.headers or bound.reason):
            metadata = {**ticket.headers, **reservation.headers}
            if bound.reason:
                metadata[OUTPUT_LIMIT] = str(bound.per_choice)
                metadata[OUTPUT_LIMIT_REASON] = bound.reason
        return Routed(
            tenant=tenant, model=model, cluster=cluster_name(model), endpoints=pick.endpoint_list,
            primary=pick.primary, body=new_body, route_metadata=metadata, lease=pick.lease, ticket=ticket,
            upstream_auth=upstream_auth, reservation=reservation, wants_usage=wants_usage, drop_usage=drop_usage,
            served_model=config.upstream_name)

    def settle(self, done: Finished, report: UsageReport | None) -> None:
        """Settle a finished request once, with Envoy's report of it (None: none came in time).

        The rule (admission/tokens.charge_for): usage reported -> charge exactly it; the body never reached
        a backend -> nothing; it did, usage unknown -> the prompt estimate when the backend answered an error,
        else the whole reservation (client gone, stream cut, no report). Then one usage record.
        """
        routed = done.routed
        reservation = routed.reservation
        cost: float | None = None
        if reservation is not None:
            if report is None:
                reservation.finish_nowait(sent=True, usage=None)
            else:
                reservation.finish_nowait(sent=report.sent, usage=report.usage, backend_error=report.backend_error)
        if self.usage_log is None:
            return
        # The record says what the reservation charged (one rule, applied once); without one nothing is
        # counted, and the record carries what Envoy saw, for the metrics.
        if reservation is not None and reservation.charged_usage is not None:
            usage, cost = reservation.charged_usage, reservation.charged_cost
        else:
            usage = report.usage if report is not None and report.usage is not None else Usage(0, 0)
        source: TokenSource = "reported" if report is not None and report.usage is not None else "estimated"
        retries = report.attempts - 1 if report is not None and report.attempts > 0 else done.retries
        self.usage_log.emit(UsageRecord(
            ts=self.clock.time(), request_id=done.rid, client_request_id=done.client_request_id,
            tenant=routed.tenant.id, model=routed.model, served_model=routed.served_model,
            endpoint=(report.endpoint if report is not None and report.endpoint else routed.lease.endpoint.address),
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens, cost=cost,
            token_source=source, termination=termination(report),
            status=report.status if report is not None else 0,
            cancelled=report.cancelled if report is not None else False, retries=max(retries, 0),
            response_bytes=report.response_bytes if report is not None else 0,
        ))

    def _record_rejection(self, head: RequestHead, rejection: Rejection, rid: str, tenant: TenantConfig,
                          model: str) -> None:
        """A refused request of a known tenant is a usage record too (termination `rejected`, nothing charged)."""
        if not self.records_on or self.usage_log is None:
            return
        self.usage_log.emit(UsageRecord(
            ts=self.clock.time(), request_id=rid or new_request_id(),
            client_request_id=head.request_id, tenant=tenant.id, model=model, served_model="", endpoint="",
            prompt_tokens=0, completion_tokens=0, token_source="estimated", termination="rejected",
            status=rejection.status, cancelled=False, retries=0,
        ))

    def models(self, head: RequestHead) -> tuple[TenantConfig, list[str]]:
        """`GET /v1/models`: the caller's tenant and the model names it may use."""
        tenant: TenantConfig | None = None
        try:
            if head.method != "GET":
                raise BadRequest(f"Use GET for {head.path}.", code="method_not_allowed")
            tenant = self.keys.authenticate(bearer_key(head.authorization))
        except Rejection as rejection:
            self._log_rejection(head, rejection, tenant, None)
            rejection.tenant = tenant.id if tenant else ""
            raise
        return tenant, self.visible_models(tenant)

    # -- the queue -------------------------------------------------------

    async def _pick(self, head: RequestHead, tenant: TenantConfig, model: str, klass: str,
                    prefix: Sequence[int], cost: int, subset: frozenset[Endpoint] | None = None,
                    output: int | None = None) -> Pick:
        """Pick + count at once when there is room and nobody waits; else wait in the queue."""
        priority = self.queues.config.priority(klass)
        self.standing.seen(model, tenant.id, tenant.weight, priority)
        queue = self.queues.waiting(model)
        headroom = self.headroom(model, tenant.id, tenant.weight, priority)
        if not headroom:
            self.standing.protected(model, cost)
        # Nobody waits (the usual path: one call), or this request is protected from those who wait
        # (a lower class, a tenant over its share): the slots they leave free are its own, so it takes
        # one at once rather than queue behind one that may not take it, on a fast endpoint.
        fast = self._prefer_fast(model, tenant.id, priority, headroom)
        if queue is None or fast:
            try:
                pick = self.picker.pick(model, prefix, cost=cost, subset=subset, prefer_fast=fast, output=output,
                                        **headroom)
                self.standing.served(model, tenant.id, cost, tenant.weight)
                return pick
            except Saturated:
                if not self.queues.config.enabled:
                    raise
        behind = queue is not None  # others wait: join them (fair order), then let dispatch decide
        queue = self.queues.get(model)
        max_wait = self.queues.config.max_wait_seconds
        speed = self.picker.ledger.speed(model) if max_wait is not None else 0.0
        item = queue.enqueue(tenant.id, cost, klass=klass, weight=tenant.weight,
                             data=(prefix, cost, subset, tenant.id, tenant.weight, priority, output),
                             max_ahead=speed * max_wait if max_wait is not None and speed > 0 else None,
                             wait_hint=max_wait, protected=self._passes(headroom),
                             shed_after=(max_wait or 0.0) * SHED_AFTER)
        if behind:
            self.dispatch(model)
        try:
            pick = await queue.wait(item)
        except Rejection as rejection:
            rejection.detail = (f"{rejection.detail}; " if rejection.detail else "") + (
                f"waited {self.clock.monotonic() - item.enqueued_at:.3f}s in the queue (class {klass})")
            raise
        except asyncio.CancelledError:
            log.info("request %s left the queue of model %s after %.3fs: the client went away (tenant=%s class=%s)",
                     head.request_id or "-", model, self.clock.monotonic() - item.enqueued_at, tenant.id, klass)
            raise
        log.info("request %s waited %.3fs in the queue of model %s (tenant=%s class=%s cost=%d) -> %s",
                 head.request_id or "-", self.clock.monotonic() - item.enqueued_at, model, tenant.id, klass, cost,
                 pick.primary.address)
        return pick

    def dispatch(self, model: str) -> None:
        """Room may have appeared for `model` (the picker's room listener): hand queued requests
        their picks while there is room. Synchronous, no I/O; a call made while dispatching (a
        release inside a claim) runs after the current one."""
        if self.queues.waiting(model) is None:
            return
        if self._dispatching:
            self._again.add(model)
            return
        self._dispatching = True
        try:
            pending = {model}
            while pending:
                name = pending.pop()
                queue = self.queues.waiting(name)
                if queue is not None:
                    queue.dispatch(lambda item, name=name: self._claim(name, item),  # type: ignore[misc]
                                   lambda item, name=name: self._protected(name, item))  # type: ignore[misc]
                pending |= self._again
                self._again.clear()
        finally:
            self._dispatching = False

    def _claim(self, model: str, item: Item[Pick]) -> Pick | None:
        """Pick and count for a queued request, or None: still no room."""
        prefix, cost, subset, tenant, weight, priority, output = cast(_Waiting, item.data)
        headroom = self.headroom(model, tenant, weight, priority)
        try:
            pick = self.picker.pick(model, prefix, cost=cost, subset=subset, output=output,
                                    prefer_fast=self._prefer_fast(model, tenant, priority, headroom), **headroom)
        except Saturated:
            return None
        self.standing.served(model, tenant, cost, weight)
        return pick

    def _passes(self, headroom: _Headroom) -> bool:
        """Will a queued request with this headroom be tried past heads that must leave room?"""
        config = self.queues.config
        return not headroom and bool(config.headroom or config.headroom_tokens)

    def _prefer_fast(self, model: str, tenant: str, priority: int, headroom: _Headroom) -> bool:
        """A protected request while others on the model must leave it room (headroom on)."""
        return (not headroom and bool(self.queues.config.headroom)
                and self.standing.contended(model, tenant, priority))

    def _protected(self, model: str, item: Item[Pick]) -> bool:
        """May a queued request use the headroom (the queue then tries it past a head that may not)?"""
        _, _, _, tenant, weight, priority, _ = cast(_Waiting, item.data)
        return not self.headroom(model, tenant, weight, priority)

    def headroom(self, model: str, tenant: str, weight: float, priority: int) -> _Headroom:
        """The request's standing as the picker takes it: the slots and tokens it must leave free
        (a class above it active, or its tenant over its share: flowcontrol/standing.py), or none
        (protected, or headroom off). Only with the queue on: headroom is what it keeps free."""
        config = self.queues.config
        if not config.enabled or not (config.headroom or config.headroom_tokens):
            return {}
        if self.standing.must_leave_headroom(model, tenant, weight, priority):
            kept = config.headroom_tokens
            if kept is None:  # each kept slot sized to the protected requests seen lately (standing.py)
                one = self.standing.kept_tokens(model)
                kept = None if one is None else one * config.headroom
            return {"headroom": config.headroom, "headroom_tokens": kept}
        return {}

    def request_class(self, tenant: TenantConfig, head: RequestHead) -> str:
        """The queue class: the tenant's, or the one its `x-priority` header asks for if allowed."""
        own = tenant.priority or self.queues.config.default_class
        asked = head.priority
        if not asked or asked == own:
            return own
        if asked in tenant.priorities_allowed:
            return asked
        allowed = sorted({own, *tenant.priorities_allowed})
        raise BadRequest(f"`{PRIORITY_HEADER}: {asked[:64]}` is not a priority this API key may use; "
                         f"use one of {', '.join(allowed)}.", code="priority_not_allowed")

    # -- the steps -------------------------------------------------------

    def resolve_model(self, tenant: TenantConfig, name: str) -> ModelConfig:
        """The model's config. Unknown and not allowed get the same answer, so that a key cannot
        learn which models exist; the log keeps the real reason."""
        model = self._models.get(name)
        if model is None:
            raise NotFound(_NO_SUCH_MODEL.format(name), detail="unknown model")
        if not tenant.allows(name):
            raise NotFound(_NO_SUCH_MODEL.format(name), detail=f"not in tenant {tenant.id}'s allowlist")
        return model

    def visible_models(self, tenant: TenantConfig) -> list[str]:
        return [name for name in self._models if tenant.allows(name)]

    def check_dispatchable(self, model: str, subset: frozenset[Endpoint] | None = None) -> None:
        """Raise 503 if no pick could succeed now."""
        if model in self.stale_models or self._xds_down_for() > self.stale_after:
            raise Unavailable(
                f"The endpoint snapshot for model `{model}` is stale: discovery has not confirmed it "
                f"for over {self.stale_after:g}s, so the gateway is not dispatching. Retry shortly.",
                code="endpoint_snapshot_stale",
            )
        self.picker.require_endpoints(model, subset=subset)

    def upstream_auth(self, model: str) -> tuple[str, str] | None:
        """(header, value) for the model's backends, None when it has no `upstream_auth`; 503 when its
        credential cannot be read (the backends would refuse the request anyway)."""
        credential = self._credentials.get(model)
        if credential is None:
            return None
        value = credential.value()
        if value is None:
            raise Unavailable(f"The gateway has no credential for the backends of model `{model}`. Retry shortly.",
                              code="upstream_credential_unavailable", detail=credential.problem)
        return credential.header, value

    @staticmethod
    def _log_rejection(head: RequestHead, rejection: Rejection, tenant: TenantConfig | None,
                       model: str | None) -> None:
        log.info(
            "rejected request %s: %d %s (tenant=%s model=%s)%s", head.request_id or "-", rejection.status,
            rejection.code, tenant.id if tenant else "-", model or "-",
            f": {rejection.detail}" if rejection.detail else "",
        )
