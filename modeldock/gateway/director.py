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
                     (`x-priority`, 400 if the tenant may not use it); the request's one `RequestCost`
                     (`request_cost`: the output bound read as the backend reads it, max_tokens, n,
                     best_of, prompt lists, 400 naming a field it cannot count; the prompt estimates)
  8. admission       in-flight slot and rate-limit windows (429 / 503)
  8b. token budgets  reserve the prompt estimate and the output bound in every budget that applies
                     (429 / 503), and write the reserved output limit into the body when the client
                     set none or the budget had less (billing.bound_output); the token cost for the
                     queue and the picker follows from that limit; a streaming request that needs usage
                     asks the backend for it (`stream_options.include_usage`, dropped again by Envoy if
                     the client did not ask)
  9. pick + count    one call, `Dispatcher.acquire(Waiting(...))` (flowcontrol/dispatcher.py): picked
                     and counted at once when there is room and nobody waits, else after a wait in the
                     model's fair queue, holding its ticket and reservation. It leaves with 429
                     queue_full / queue_timeout, or at once when its client goes (ticket released,
                     tokens refunded).

A reservation is refunded at once if the request is refused after it (pick, queue); otherwise it
is settled once, from Envoy's access log, by `Gateway.settle` (settlement.py joins the two).

Two adapters call `route`: extproc/flow.py (modeldock's own Envoy bootstrap) and epp/flow.py
(the Endpoint Picker protocol); a request's id, its open state and its settlement are the lifecycle
registry's (gateway/lifecycle.py), which calls `settle` once.

Every refusal is a `modeldock.errors.Rejection`, logged here with the request id and
the tenant and model when known; the adapter renders it (modeldock/replies.py).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Mapping

from modeldock.admission.keys import KeyStore
from modeldock.admission.limits import Admission
from modeldock.budgets.budgets import Reservation, TokenBudgets, has_budgets
from modeldock.budgets.headers import OUTPUT_LIMIT, OUTPUT_LIMIT_REASON
from modeldock.budgets.pricing import Price, model_price
from modeldock.budgets.tokens import Usage
from modeldock.clock import Clock
from modeldock.config import Config, ModelConfig, TenantConfig
from modeldock.errors import BadRequest, NotFound, Rejection, Unavailable
from modeldock.flowcontrol import QueueMetrics, Waiting
from modeldock.flowcontrol.cost import request_cost
from modeldock.flowcontrol.dispatcher import Dispatcher
from modeldock.gateway.billing import Bound, bound_output, termination
from modeldock.gateway.credentials import UpstreamCredential
from modeldock.gateway.request import PRIORITY_HEADER, RequestHead, bearer_key, check_length, parse_body
from modeldock.gateway.routed import Destination, Finished, Holdings, Routed, UsagePlan, ask_for_usage
from modeldock.gateway.settlement import UsageReport
from modeldock.picking import Picker
from modeldock.picking.prefix import prompt_blocks
from modeldock.types import Endpoint, cluster_name
from modeldock.usage.log import UsageLog
from modeldock.usage.record import TokenSource, UsageRecord, new_request_id

log = logging.getLogger("modeldock.extproc")

CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATHS = frozenset({CHAT_PATH, "/v1/completions"})
MODELS_PATH = "/v1/models"
# OpenAI's wording, for an unknown model and for one the key may not use alike.
_NO_SUCH_MODEL = "The model `{}` does not exist or you do not have access to it."


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
        # Flow control behind one call (acquire); the picker's room listener wakes its queues.
        self.flow = Dispatcher(config.queue, clock, pick=picker.pick, speed=picker.speed, metrics=queue_metrics)
        picker.add_room_listener(self.flow.dispatch)
        self._load(config)

    def apply_config(self, config: Config) -> None:
        """Swap tenants, models and limits on reload."""
        self.admission.reconfigure(config)
        if config.queue != self.flow.config:
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
            cost, normalised = request_cost(data, len(body), chat=chat,
                                            default_per_choice=self.flow.config.default_max_tokens)
            ticket = await self.admission.admit(tenant, model)
            reservation: Reservation | None = None
            bound = Bound(cost.limit.per_choice, "")
            try:
                if self.records_on or has_budgets(tenant):
                    limit = cost.limit
                    reservation = await self.budgets.reserve(
                        tenant, config.upstream_name, rid or f"route-{next(self._route_ids)}",
                        prompt=cost.prompt_bound, output=limit.tokens(self.config.limits.reserve_completion_tokens),
                        min_output=limit.choices, price=self._prices.get(model))
                    # The body's output limit is never above what was reserved for it.
                    bound = bound_output(data, limit, reservation.output, capped=reservation.capped, chat=chat)
                    if bound.per_choice is not None and bound.reason:
                        cost = cost.bounded(bound.per_choice)
            except BaseException:
                ticket.release()
                raise
            try:
                pick = await self.flow.acquire(Waiting(
                    model=model, tenant=tenant.id, weight=tenant.weight, klass=klass, cost=cost.total,
                    output=cost.max_new_tokens, prefix=prefix, subset=subset, request_id=head.request_id))
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
            tenant=tenant, model=model,
            destination=Destination(cluster=cluster_name(model), endpoints=pick.endpoint_list, primary=pick.primary,
                                    body=new_body, route_metadata=metadata, upstream_auth=upstream_auth),
            holdings=Holdings(lease=pick.lease, ticket=ticket, reservation=reservation),
            usage=UsagePlan(served_model=config.upstream_name, wants_usage=wants_usage, drop_usage=drop_usage))

    def settle(self, done: Finished, report: UsageReport | None) -> None:
        """Settle a finished request once, with Envoy's report of it (None: none came in time).

        The rule (budgets/tokens.charge_for): usage reported -> charge exactly it; the body never reached
        a backend -> nothing; it did, usage unknown -> the prompt estimate when the backend answered an error,
        else the whole reservation (client gone, stream cut, no report). Then one usage record.
        """
        routed = done.routed
        reservation = routed.holdings.reservation
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
            tenant=routed.tenant.id, model=routed.model, served_model=routed.usage.served_model,
            endpoint=(report.endpoint if report is not None and report.endpoint
                      else routed.holdings.lease.endpoint.address),
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

    # -- the steps -------------------------------------------------------

    def request_class(self, tenant: TenantConfig, head: RequestHead) -> str:
        """The queue class: the tenant's, or the one its `x-priority` header asks for if allowed."""
        own = tenant.priority or self.flow.config.default_class
        asked = head.priority
        if not asked or asked == own:
            return own
        if asked in tenant.priorities_allowed:
            return asked
        allowed = sorted({own, *tenant.priorities_allowed})
        raise BadRequest(f"`{PRIORITY_HEADER}: {asked[:64]}` is not a priority this API key may use; "
                         f"use one of {', '.join(allowed)}.", code="priority_not_allowed")

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
