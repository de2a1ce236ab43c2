"""The gateway's domain state and the director that routes one request through it.

Plain typed Python, no gRPC and no protobuf: `extproc/flow.py` translates Envoy's
messages into `Gateway.route(head, body)` / `Gateway.models(head)` and the answer
back. The ADS client feeds endpoints and staleness in (`on_endpoints`, `on_status`).

`route` runs every step of a completion request, in this order, each once:

  1. route check     path and method (404 / 400)
  2. authenticate    one Bearer key -> tenant (401)
  3. length          body size against `limits.max_body_bytes` (413)
  4. parse           JSON object with a valid `model` (400)
  5. resolve model   known and allowed for the tenant (one 404 for both); alias rewrite
  6. dispatchable    snapshot fresh and endpoints present, the model's upstream credential
                     readable (503), before admission so a request that cannot be served
                     keeps the tenant's rate-limit quota
  7. prompt blocks   the prompt's block hashes, for prefix affinity
  8. admission       in-flight slot and rate-limit windows (429 / 503); the one await
  9. pick + count    `Picker.pick(model, prefix)`, synchronous, right after admission

Where later features go:
  - a gateway-side queue before pick: between 8 and 9, in `route` (hold the ticket,
    await a slot, then pick; release the ticket if the wait is cancelled);
  - token-budget reservation: inside admission (step 8), `Admission.admit` returns the
    reservation on the Ticket, released with it;
  - an Endpoint-Picker protocol adapter (GIE's EPP): a second adapter beside extproc/flow.py
    that calls the same `route` and renders `Routed` in its own protocol.

Every refusal is a `modeldock.errors.Rejection`, logged here with the request id and
the tenant and model when known; the adapter renders it (extproc/responses.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from modeldock.admission.keys import KeyStore
from modeldock.admission.limits import Admission, Ticket
from modeldock.clock import Clock
from modeldock.config import Config, ModelConfig, TenantConfig
from modeldock.errors import BadRequest, NotFound, Rejection, Unavailable
from modeldock.gateway.credentials import UpstreamCredential
from modeldock.gateway.request import RequestHead, bearer_key, check_length, parse_body
from modeldock.picking import Lease, Picker
from modeldock.picking.prefix import prompt_blocks
from modeldock.types import Endpoint
from modeldock.xds.resources import cluster_name

log = logging.getLogger("modeldock.extproc")

COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
MODELS_PATH = "/v1/models"
# OpenAI's wording, for an unknown model and for one the key may not use alike.
_NO_SUCH_MODEL = "The model `{}` does not exist or you do not have access to it."


@dataclass(frozen=True, slots=True)
class Routed:
    """Where a routed request goes and what it holds. The caller releases `lease` and
    `ticket` exactly once, when the HTTP stream ends (`release()`)."""

    tenant: TenantConfig
    model: str  # the public name the client sent
    cluster: str  # Envoy's cluster for the model
    endpoints: str  # override_host list: primary first, then ranked fallbacks
    primary: Endpoint
    body: bytes | None  # the body to send upstream instead (an alias rewrite), or None: unchanged
    route_metadata: Mapping[str, str]  # x-ratelimit-* values the route adds to the response
    lease: Lease
    ticket: Ticket
    # (header, value) the gateway sends the backend (the model's `upstream_auth`); never in a repr or log.
    upstream_auth: tuple[str, str] | None = field(default=None, repr=False)

    def release(self) -> None:
        """Idempotent: both parts ignore a second release."""
        self.lease.release()
        self.ticket.release()


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
    ) -> None:
        self.clock = clock
        self.picker = picker
        self.admission = admission
        self._xds_down_for = xds_down_for
        self.stale_models: frozenset[str] = frozenset()
        self._load(config)

    def apply_config(self, config: Config) -> None:
        """Swap tenants, models and limits on reload."""
        self.admission.reconfigure(config)
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

    # -- fed by the ADS client -------------------------------------------

    def on_endpoints(self, model: str, endpoints: tuple[Endpoint, ...]) -> None:
        config = self._models.get(model)
        # vLLM labels its metrics with the name it serves, which an alias may hide.
        self.picker.set_endpoints(model, endpoints, served_name=config.upstream_name if config else None)

    def on_status(self, stale_models: frozenset[str]) -> None:
        self.stale_models = stale_models

    # -- the director ----------------------------------------------------

    async def route(self, head: RequestHead, body: bytes, *, subset: frozenset[Endpoint] | None = None) -> Routed:
        """Steps 1-9 of the module docstring; raises a Rejection, holding nothing, when one refuses.
        `subset`: only these endpoints may serve it (a gateway's hint, modeldock/epp/)."""
        tenant: TenantConfig | None = None
        model: str | None = None
        try:
            check_route(head)
            tenant = self.keys.authenticate(bearer_key(head.authorization))
            check_length(len(body), self.max_body_bytes)
            data = parse_body(body)
            model = str(data["model"])
            config = self.resolve_model(tenant, model)
            new_body: bytes | None = None
            if config.upstream_name != model:
                data["model"] = config.upstream_name
                new_body = json.dumps(data, separators=(",", ":")).encode()
            self.check_dispatchable(model, subset)
            upstream_auth = self.upstream_auth(model)
            prefix = prompt_blocks(data)
            ticket = await self.admission.admit(tenant, model)
            # No await from here on: pick and count happen in one step.
            try:
                pick = self.picker.pick(model, prefix, subset=subset)
            except BaseException:
                ticket.release()
                raise
        except Rejection as rejection:
            self._log_rejection(head, rejection, tenant, model)
            raise
        return Routed(tenant, model, cluster_name(model), pick.endpoint_list, pick.primary, new_body,
                      ticket.headers, pick.lease, ticket, upstream_auth)

    def models(self, head: RequestHead) -> list[str]:
        """`GET /v1/models`: the model names the caller's tenant may use."""
        tenant: TenantConfig | None = None
        try:
            if head.method != "GET":
                raise BadRequest(f"Use GET for {head.path}.", code="method_not_allowed")
            tenant = self.keys.authenticate(bearer_key(head.authorization))
        except Rejection as rejection:
            self._log_rejection(head, rejection, tenant, None)
            raise
        return self.visible_models(tenant)

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
