"""What the director hands back: the routed request, its end, and the token-cost helpers it uses.

Plain data: `Routed` is what a protocol adapter renders and releases; `Finished` is a routed request
whose stream ended, waiting for its usage (settlement.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from modeldock.admission.limits import Ticket
from modeldock.budgets.budgets import Reservation
from modeldock.config import TenantConfig
from modeldock.picking import Lease
from modeldock.types import Endpoint


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
    # Token budgets and usage: the reservation (None when no budget applies), whether Envoy's access log
    # must bring the request's usage back (`modeldock:usage`), and whether Envoy drops the usage chunk
    # the gateway asked the backend for (`modeldock:drop_usage`).
    reservation: Reservation | None = None
    wants_usage: bool = False
    drop_usage: bool = False
    served_model: str = ""

    def release(self) -> None:
        """Idempotent: both parts ignore a second release."""
        self.lease.release()
        self.ticket.release()


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
