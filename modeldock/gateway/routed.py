"""What the director hands back: the routed request, its end, and the token-cost helpers it uses.

Plain data: `Routed` is what a protocol adapter renders and releases, built by keyword from its parts
(`Destination`, `Holdings`, `UsagePlan`); `Finished` is a routed request whose stream ended, waiting
for its usage (settlement.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from modeldock.admission.limits import Ticket
from modeldock.budgets.budgets import Reservation
from modeldock.config import TenantConfig
from modeldock.picking import Lease
from modeldock.types import Endpoint


@dataclass(frozen=True, slots=True, kw_only=True)
class Destination:
    """Where a routed request goes, and what it carries there."""

    cluster: str  # Envoy's cluster for the model
    endpoints: str  # override_host list: primary first, then ranked fallbacks
    primary: Endpoint
    body: bytes | None  # the body to send upstream instead (a rewrite), or None: unchanged
    route_metadata: Mapping[str, str]  # x-ratelimit-* (and output-limit) values the route adds to the response
    # (header, value) the gateway sends the backend (the model's `upstream_auth`); never in a repr or log.
    upstream_auth: tuple[str, str] | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Holdings:
    """What a routed request holds until its stream ends: its in-flight lease and admission ticket,
    released exactly once (`release()`), and its token reservation (None when no budget or records
    apply), settled once by the lifecycle registry."""

    lease: Lease
    ticket: Ticket
    reservation: Reservation | None = None

    def release(self) -> None:
        """Idempotent: both parts ignore a second release."""
        self.lease.release()
        self.ticket.release()


@dataclass(frozen=True, slots=True, kw_only=True)
class UsagePlan:
    """How the request's usage comes back: whether Envoy's access log must bring it (`modeldock:usage`),
    and whether Envoy drops the usage chunk the gateway asked the backend for (`modeldock:drop_usage`)."""

    served_model: str  # the name the backend serves (an alias's upstream name)
    wants_usage: bool = False
    drop_usage: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Routed:
    """A routed request, by its parts. The caller releases its holdings exactly once, when the HTTP
    stream ends (`release()`)."""

    tenant: TenantConfig
    model: str  # the public name the client sent
    destination: Destination
    holdings: Holdings
    usage: UsagePlan

    def release(self) -> None:
        self.holdings.release()


@dataclass(frozen=True, slots=True)
class Finished:
    """A routed request whose stream ended: what `Gateway.settle` needs. Built by the registry
    (lifecycle.py, `Outcome.finished`) and settled once, at once or when its usage report comes."""

    routed: Routed
    rid: str
    client_request_id: str
    retries: int


def ask_for_usage(data: dict[str, object]) -> bool:
    """Make a streaming request ask the backend for its usage (the final chunk). True when the gateway
    added it, so Envoy must drop that chunk: the client did not ask for it. A request that is not
    streaming, that asks already, or whose `stream_options` is not an object is left as it is."""
    if data.get("stream") is not True:
        return False
    options = data.get("stream_options")
    if options is None:
        data["stream_options"] = {"include_usage": True}
        return True
    if not isinstance(options, dict) or options.get("include_usage") is True:
        return False
    data["stream_options"] = {**options, "include_usage": True}
    return True
