"""One hierarchy for every rejection the gateway makes.

Each rejection carries the HTTP status, the OpenAI error `type` and `code`, a
message that is safe to show the client, optional extra response headers, and
an optional `detail` for the log alone (never sent to the client), and the
tenant and model the director had resolved when it refused (for metric labels).
`modeldock.replies.rejection_response` is the one place that turns a rejection into an
Envoy ImmediateResponse (for both adapters); Envoy's own replies get the same bodies from
`extproc.responses.local_reply_config`.
"""

from __future__ import annotations

from collections.abc import Mapping


class Rejection(Exception):
    status: int = 500
    type: str = "server_error"
    code: str = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        detail: str = "",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param  # the request field at fault, when one is (OpenAI's `param`)
        self.detail = detail  # for the log only: the real reason when the message hides it
        if code is not None:
            self.code = code
        self.headers: dict[str, str] = dict(headers or {})
        # Set by the director: the configured tenant id once the key authenticated and the configured
        # model name once resolved, else "" (never the client's text: these become metric labels).
        self.tenant = ""
        self.model = ""

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(Rejection):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(Rejection):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(Rejection):
    status = 403
    type = "invalid_request_error"
    code = "model_not_allowed"


class NotFound(Rejection):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class PayloadTooLarge(Rejection):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(Rejection):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class Unavailable(Rejection):
    status = 503
    type = "server_error"
    code = "service_unavailable"


class GatewayTimeout(Rejection):
    status = 504
    type = "server_error"
    code = "upstream_timeout"


def limiter_unavailable() -> Unavailable:
    """The shared rate-limit store (Redis) did not answer and the limits fail closed."""
    return Unavailable(
        "Rate limiting is unavailable right now, so the request was not admitted. Retry shortly.",
        code="rate_limiter_unavailable",
        headers={"Retry-After": "1"},
    )
