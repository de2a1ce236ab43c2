"""The gateway's one YAML config file: tenants, models, routing and limits.

Validation is pydantic's; `load_config` turns its errors into one message that
names the file, the field and the reason.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from modeldock.flowcontrol.config import QueueConfig
from modeldock.picking.config import RoutingConfig  # imports pydantic only (picking/__init__ is lazy)
from modeldock.redis_auth import RedisAuthConfig, auth_problem
from modeldock.sharing.config import SharingConfig
from modeldock.types import Endpoint
from modeldock.usage.config import UsageConfig

HASH_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,254}$")


class ConfigError(Exception):
    """A config that cannot be used; the message names file, field and reason."""


class _FieldError(ValueError):
    """Raised by a whole-config check to name the field at fault (`loc`), not the top level."""

    def __init__(self, loc: tuple[int | str, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


def hash_key(key: str) -> str:
    """The stored form of an API key."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TenantConfig(_Strict):
    id: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]
    api_key_hashes: Annotated[list[str], Field(min_length=1)]
    models: Annotated[list[str], Field(min_length=1)]  # exact names or globs
    requests_per_minute: Annotated[int, Field(ge=0)] = 0  # 0 means no limit
    # Keys are model names or globs, matched against every model's public and served name;
    # the window is per served name (see modeldock/admission/README.md).
    requests_per_minute_per_model: dict[str, Annotated[int, Field(ge=1)]] = {}
    max_in_flight: Annotated[int, Field(ge=0)] = 0  # 0 means no limit
    # Token budgets (budgets/budgets.py); 0 or absent means no budget. Per-model keys are globs
    # matched against the served model name; each pattern is one budget shared by the models it matches.
    tokens_per_minute: Annotated[int, Field(ge=0)] = 0
    tokens_per_minute_per_model: dict[str, Annotated[int, Field(ge=1)]] = {}
    # Calendar periods in `budget_timezone` (default limits.budget_timezone): reset at local midnight.
    tokens_per_day: Annotated[int, Field(ge=0)] = 0
    tokens_per_month: Annotated[int, Field(ge=0)] = 0
    # Cost budgets in the models' price currency (every model the tenant may use needs a `price`).
    cost_per_day: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    cost_per_month: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    budget_timezone: str | None = None  # an IANA zone name, e.g. Europe/Berlin
    # Flow control (modeldock/flowcontrol): the tenant's share of a saturated model's queue (by tokens),
    # its queue class (`queue.classes`; default `queue.default_class`), and the other classes its
    # requests may ask for with the `x-priority` header.
    weight: Annotated[float, Field(gt=0, le=1000)] = 1.0
    priority: str | None = None
    priorities_allowed: list[str] = []

    @field_validator("api_key_hashes")
    @classmethod
    def _hashes(cls, value: list[str]) -> list[str]:
        for item in value:
            if not HASH_RE.match(item):
                raise ValueError("each entry must be sha256:<64 lowercase hex>; make one with `modeldock keys hash`")
        return value

    @field_validator("budget_timezone")
    @classmethod
    def _tenant_zone(cls, value: str | None) -> str | None:
        return None if value is None else _time_zone(value)

    def allows(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)


def _time_zone(value: str) -> str:
    """An IANA time zone name that zoneinfo can load (budget periods are computed in it)."""
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    if not value or value != value.strip() or value.startswith(("/", ".")) or ".." in value:
        raise ValueError("must be an IANA time zone name such as UTC or Europe/Berlin")
    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ValueError(f"{value!r} is not a known IANA time zone name (e.g. UTC, Europe/Berlin)") from None
    return value


class PriceConfig(_Strict):
    """A model's price per million tokens (cost budgets, usage records' cost)."""

    input: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    output: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    cached_input: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None  # absent: the input price


class KubernetesTarget(_Strict):
    namespace: Annotated[str, Field(min_length=1)]
    service: Annotated[str, Field(min_length=1)]
    port: int | str  # port number or port name in the EndpointSlice


# Headers a model's upstream credential may go in: Envoy's bootstrap sets each from its own metadata key
# (modeldock.upstream_auth:<header>), so a config reload never needs a new Envoy config.
UPSTREAM_AUTH_HEADERS = ("authorization", "x-api-key", "api-key")


class UpstreamAuthConfig(_Strict):
    """The credential the gateway sends a model's backends (vLLM's --api-key), from exactly one of
    an environment variable (read at load) or a file (re-read when it changes)."""

    header: Literal["authorization", "x-api-key", "api-key"] = "authorization"
    scheme: str = "Bearer"  # the value is "<scheme> <secret>"; empty: the secret alone (x-api-key)
    env: str | None = None
    file: str | None = None

    @field_validator("header", mode="before")
    @classmethod
    def _header(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value  # header names are case-insensitive

    @field_validator("scheme")
    @classmethod
    def _scheme(cls, value: str) -> str:
        if value and not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+", value):
            raise ValueError("must be one token such as Bearer, or empty for the bare secret")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
            raise ValueError("must be an environment variable name")
        return value

    @field_validator("file")
    @classmethod
    def _file(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must be a file path")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> UpstreamAuthConfig:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of `env` or `file`")
        return self


class ModelConfig(_Strict):
    name: str
    served_name: str | None = None  # the name the backend knows; defaults to `name`
    endpoints: list[str] | None = None
    kubernetes: KubernetesTarget | None = None
    protocol: Literal["http1", "http2"] = "http1"
    upstream_auth: UpstreamAuthConfig | None = None  # the credential sent to the backends
    # The backends' batch limit (vLLM --max-num-seqs), for the room rules from the start; without
    # it the limit is learned when a backend queues for a slot, which one kept from queueing never does.
    max_num_seqs: Annotated[int, Field(ge=1)] | None = None
    price: PriceConfig | None = None  # per million tokens; required by tenants with a cost budget

    @field_validator("name", "served_name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not MODEL_NAME_RE.match(value):
            raise ValueError("must be 1-255 characters of letters, digits and ._:/@+-")
        return value

    @field_validator("endpoints")
    @classmethod
    def _endpoints(cls, value: list[str] | None) -> list[str] | None:
        for item in value or ():
            Endpoint.parse(item)
        return value

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.endpoints is None) == (self.kubernetes is None):
            raise ValueError("give exactly one of `endpoints` or `kubernetes`")
        return self

    @property
    def source(self) -> Literal["static", "kubernetes"]:
        """Which discovery source publishes this model (discovery/sources.py)."""
        return "static" if self.endpoints is not None else "kubernetes"

    @property
    def upstream_name(self) -> str:
        return self.served_name or self.name

    def matches(self, pattern: str) -> bool:
        """A per-model limit key (a name or glob) covers this model by its public or its served name."""
        return fnmatch.fnmatchcase(self.name, pattern) or fnmatch.fnmatchcase(self.upstream_name, pattern)

    def static_endpoints(self) -> tuple[Endpoint, ...]:
        return tuple(Endpoint.parse(item) for item in self.endpoints or ())


def redis_auth_problem(url: str | None, auth: RedisAuthConfig | None) -> str | None:
    """What stops `auth` from applying to `url` (never quoting it), or None; no URL yet: checked when
    $REDIS_URL supplies one."""
    if url is None or auth is None:
        return None
    problem = auth_problem(url, auth)
    return None if problem is None else f"limits.redis_auth.{problem}"


class LimitsConfig(_Strict):
    # redis://, rediss:// (host required), unix:// (socket path required), or a master found through Redis
    # Sentinel: redis+sentinel://[user[:password]@]host[:port][,host[:port]...]/<master-name>[/<db>]
    # (rediss+sentinel:// for TLS to the Sentinels and the master, with limits.redis_auth's TLS options)
    # (Sentinel port 26379 by default; user and password are the master's; the Sentinels' own AUTH, if
    # any, in ?sentinel_username=...&sentinel_password=...). Admission README, "Redis topologies".
    redis_url: str | None = None
    # The Redis is a Redis Cluster (ElastiCache/Memorystore cluster mode, Valkey cluster): redis_url is a
    # redis:// or rediss:// URL of any one node (db 0), the client finds the rest and follows MOVED/ASK.
    # Admission README, "Redis Cluster".
    redis_cluster: bool = False
    # Credentials from a file or an environment variable (re-read at every new connection: rotated without
    # a restart) and TLS options for a rediss:// URL. Admission README, "TLS and credentials".
    redis_auth: RedisAuthConfig | None = None
    redis_fail_open: bool = False
    redis_timeout_ms: Annotated[int, Field(ge=1, le=5000)] = 50
    max_body_bytes: Annotated[int, Field(ge=1024)] = 4 * 1024 * 1024
    # Completion tokens reserved for a request that sets no max_tokens (token budgets only).
    reserve_completion_tokens: Annotated[int, Field(ge=1)] = 1024
    # A request whose output limit does not fit the tenant's remaining budget, while its prompt and one
    # token per choice do, is sent with the limit lowered to what fits (x-modeldock-output-limit-reason:
    # budget) instead of refused; false: refused with 429 tokens_rate_limited.
    cap_output_to_budget: bool = True
    # Token budgets in Redis: how long a replica admits from a block of tokens it reserved there
    # (budgets/README.md "Token leases"); 0 reserves each request in Redis on its own.
    token_lease_ms: Annotated[int, Field(ge=0, le=10_000)] = 1000
    # The zone of calendar budgets (tokens_per_day/month, cost_per_day/month); a tenant may override it.
    budget_timezone: str = "UTC"

    @field_validator("budget_timezone")
    @classmethod
    def _zone(cls, value: str) -> str:
        return _time_zone(value)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        problem = None if value is None else redis_url_problem(value)
        if problem is not None:
            raise ValueError(problem)  # the message never holds the URL: it may carry a password
        return value

    @model_validator(mode="after")
    def _cluster_url(self) -> LimitsConfig:
        problem = None if self.redis_url is None else cluster_url_problem(self.redis_url, self.redis_cluster)
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _auth_url(self) -> LimitsConfig:
        problem = redis_auth_problem(self.redis_url, self.redis_auth)
        if problem is not None:
            raise ValueError(problem)
        return self


class DiscoveryConfig(_Strict):
    stale_after_seconds: Annotated[float, Field(gt=0)] = 15.0


class ListenerConfig(_Strict):
    """Envoy's front door, rendered into its bootstrap by `modeldock up` and `modeldock envoy-config --config`.

    Slow or idle clients are cut on these clocks; none of them bounds a response, so long
    generations run on (`stream_idle_timeout_seconds` only cuts a stream silent that long).
    """

    request_headers_timeout_seconds: Annotated[float, Field(gt=0)] = 10.0  # all request headers in
    request_timeout_seconds: Annotated[float, Field(gt=0)] = 60.0  # the whole request (headers and body) in
    idle_timeout_seconds: Annotated[float, Field(gt=0)] = 60.0  # a connection with no open request
    stream_idle_timeout_seconds: Annotated[float, Field(gt=0)] = 300.0  # no byte either way on a stream
    max_concurrent_streams: Annotated[int, Field(ge=1, le=2**31 - 1)] = 100  # per HTTP/2 connection
    max_connections: Annotated[int, Field(ge=1)] = 50_000
    max_heap_bytes: Annotated[int, Field(ge=1024 * 1024)] = 768 * 1024 * 1024  # Envoy's overload manager
    # Each ext_proc answer, which includes a request's wait in the queue. Default: the queue's
    # `ttl_seconds` + QUEUE_ANSWER_MARGIN_SECONDS (2 s without a queue); must exceed that.
    ext_proc_message_timeout_seconds: Annotated[float, Field(gt=0)] | None = None

    def message_timeout(self, queue: QueueConfig | None = None) -> float:
        """The ext_proc message timeout: as set, or derived from the queue's TTL."""
        if self.ext_proc_message_timeout_seconds is not None:
            return self.ext_proc_message_timeout_seconds
        return default_message_timeout(queue if queue is not None else QueueConfig())


# Between the queue's TTL and Envoy giving up on ext_proc's answer: admission (Redis), the pick,
# and the answer's trip back. The message timeout must exceed TTL + the minimum; the default
# leaves TTL + the default margin.
QUEUE_ANSWER_MIN_MARGIN_SECONDS = 1.0
QUEUE_ANSWER_MARGIN_SECONDS = 2.0
NO_QUEUE_MESSAGE_TIMEOUT_SECONDS = 2.0


def default_message_timeout(queue: QueueConfig) -> float:
    if not queue.enabled:
        return NO_QUEUE_MESSAGE_TIMEOUT_SECONDS
    return queue.ttl_seconds + QUEUE_ANSWER_MARGIN_SECONDS


class Config(_Strict):
    tenants: list[TenantConfig] = []
    models: Annotated[list[ModelConfig], Field(min_length=1)]
    routing: RoutingConfig = RoutingConfig()
    limits: LimitsConfig = LimitsConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    listener: ListenerConfig = ListenerConfig()
    queue: QueueConfig = QueueConfig()
    sharing: SharingConfig = SharingConfig()
    # Per-request usage records (modeldock/usage/README.md); absent = none written.
    usage: UsageConfig | None = None

    @model_validator(mode="after")
    def _unique(self) -> Config:
        for kind, names in (("models", [m.name for m in self.models]), ("tenants", [t.id for t in self.tenants])):
            seen: set[str] = set()
            for name in names:
                if name in seen:
                    raise ValueError(f"{kind}: {name!r} appears twice")
                seen.add(name)
        return self

    @model_validator(mode="after")
    def _per_model_keys_match(self) -> Config:
        # A key that matches nothing limits nothing: most likely a typo, so refuse it.
        for i, tenant in enumerate(self.tenants):
            for key in tenant.requests_per_minute_per_model:
                if not any(model.matches(key) for model in self.models):
                    raise _FieldError(("tenants", i, "requests_per_minute_per_model"), f"{key!r} matches no model")
            for key in tenant.tokens_per_minute_per_model:  # budgets are keyed on the served name
                if not any(fnmatch.fnmatchcase(model.upstream_name, key) for model in self.models):
                    raise _FieldError(("tenants", i, "tokens_per_minute_per_model"),
                                      f"{key!r} matches no model's served name")
        return self

    @model_validator(mode="after")
    def _cost_budgets_priced(self) -> Config:
        # A cost budget cannot count a model without a price: refuse rather than let it run free.
        for i, tenant in enumerate(self.tenants):
            field = "cost_per_month" if tenant.cost_per_month else "cost_per_day" if tenant.cost_per_day else ""
            if not field:
                continue
            for model in self.models:
                if model.price is None and tenant.allows(model.name):
                    raise _FieldError(("tenants", i, field),
                                      f"needs a price on every model the tenant may use; model {model.name!r} "
                                      "has none (models[].price)")
        return self

    @model_validator(mode="after")
    def _classes_exist(self) -> Config:
        classes = self.queue.classes
        for i, tenant in enumerate(self.tenants):
            if tenant.priority is not None and tenant.priority not in classes:
                raise _FieldError(("tenants", i, "priority"),
                                  f"{tenant.priority!r} is not one of queue.classes {sorted(classes)}")
            for name in tenant.priorities_allowed:
                if name not in classes:
                    raise _FieldError(("tenants", i, "priorities_allowed"),
                                      f"{name!r} is not one of queue.classes {sorted(classes)}")
        return self

    @model_validator(mode="after")
    def _timeouts_cover_the_queue(self) -> Config:
        """Envoy must wait for ext_proc's answer while a request waits in the queue, and its
        request_timeout (which runs until the request has gone upstream) must cover that answer."""
        listener = self.listener
        timeout = listener.message_timeout(self.queue)
        if listener.ext_proc_message_timeout_seconds is None:
            # Resolved here, so that whoever renders Envoy's bootstrap from `listener` alone gets it.
            listener = listener.model_copy(update={"ext_proc_message_timeout_seconds": timeout})
            object.__setattr__(self, "listener", listener)
        if self.queue.enabled and timeout <= self.queue.ttl_seconds + QUEUE_ANSWER_MIN_MARGIN_SECONDS:
            raise _FieldError(("listener", "ext_proc_message_timeout_seconds"),
                              f"{timeout:g}s must exceed queue.ttl_seconds ({self.queue.ttl_seconds:g}s) plus "
                              f"{QUEUE_ANSWER_MIN_MARGIN_SECONDS:g}s; raise it or lower the queue's TTL")
        if listener.request_timeout_seconds <= timeout:
            raise _FieldError(("listener", "request_timeout_seconds"),
                              f"{listener.request_timeout_seconds:g}s must exceed the ext_proc message timeout "
                              f"({timeout:g}s): it includes ext_proc's answer")
        return self

    def model(self, name: str) -> ModelConfig | None:
        for model in self.models:
            if model.name == name:
                return model
        return None


def _where(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out or "(top level)"


# An unknown key is named only when it looks like a field name: a mis-indented line can turn a value
# (a URL with its password, say) into a key.
_FIELD_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")


def parse_config(data: object, source: str = "<config>") -> Config:
    """The config from parsed YAML. Messages come from `loc` and pydantic's `msg`, never `input`."""
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors(include_url=False, include_input=False):
            # pydantic adds the validator kind to `loc` for unions; drop non-field parts.
            loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "union["))))
            if err["type"] == "extra_forbidden" and loc and not _FIELD_NAME_RE.match(str(loc[-1])):
                loc = (*loc[:-1], "(a key that is not a field name, not shown)")
            cause = err.get("ctx", {}).get("error")
            if isinstance(cause, _FieldError):
                loc = (*loc, *cause.loc)
            reason = err["msg"].removeprefix("Value error, ")
            lines.append(f"{source}: {_where(loc)}: {reason}")
        raise ConfigError("\n".join(lines)) from None


REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel")
_SCHEMES_TEXT = "redis://, rediss://, unix://, redis+sentinel:// or rediss+sentinel://"


def redis_url_problem(url: str) -> str | None:
    """What is wrong with a Redis URL (redis-py's forms, or a redis+sentinel:// one), or None; the answer
    never quotes the URL."""
    if url[:17].lower() == "redis+sentinel://" or url[:18].lower() == "rediss+sentinel://":
        # Deferred: the parser lives with the client factory, and only a Sentinel URL needs redis-py here.
        from modeldock.redis_client import parse_sentinel_url

        try:
            parse_sentinel_url(url)
        except ValueError as exc:
            return str(exc)  # says what is wrong, never quotes the URL
        return None
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a port that is not a number in 0-65535
    except ValueError:
        return f"must be a {_SCHEMES_TEXT} URL (this one does not parse: a bad port or host)"
    if parts.scheme not in REDIS_SCHEMES:
        return f"must start with {_SCHEMES_TEXT} (the URL is not shown: it may hold a password)"
    if parts.scheme == "unix":
        return None if parts.path not in ("", "/") else "a unix:// URL needs the socket's path (unix:///path/to.sock)"
    if not parts.hostname:
        return f"a {parts.scheme}:// URL needs a host ({parts.scheme}://host:6379/0)"
    if port == 0:
        return "the port must be 1-65535"
    return None


def cluster_url_problem(url: str, cluster: bool) -> str | None:
    """What stops `url` from naming a Redis Cluster node when `cluster` is set, or None (never quotes it)."""
    if not cluster:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        return ("limits.redis_cluster: true needs a redis:// or rediss:// URL of one cluster node "
                "(not a unix socket or a Sentinel URL)")
    if parts.path.strip("/") not in ("", "0"):
        return "limits.redis_cluster: true needs database 0 in the URL (a Redis Cluster has only db 0)"
    return None


def with_env_redis(config: Config, environ: Mapping[str, str]) -> Config:
    """`$REDIS_URL` for the shared rate-limit windows when the config sets no `limits.redis_url`."""
    url = environ.get("REDIS_URL")
    if not url or config.limits.redis_url is not None:
        return config
    problem = (redis_url_problem(url) or cluster_url_problem(url, config.limits.redis_cluster)
               or redis_auth_problem(url, config.limits.redis_auth))
    if problem is not None:
        raise ConfigError(f"$REDIS_URL (applied as limits.redis_url): {problem}")
    return config.model_copy(update={"limits": config.limits.model_copy(update={"redis_url": url})})


def load_config(path: str | Path, *, environ: Mapping[str, str] | None = None) -> Config:
    """The config file, with `$REDIS_URL` from `environ` (default: the process's) applied."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte offset {exc.start})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}:{_yaml_problem(exc, text)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: (top level): must be a mapping with `models` and `tenants`")
    return with_env_redis(parse_config(data, str(path)), os.environ if environ is None else environ)


# A quoted fragment in PyYAML's problem text is kept only when it is YAML syntax ("','", "'<stream end>'");
# one with letters or digits (an alias, a tag, an escape) is source text and may be part of a secret.
_QUOTED_RE = re.compile(r"'[^']*'|\"[^\"]*\"")


def _redact_quoted(text: str) -> str:
    def keep(match: re.Match[str]) -> str:
        quoted = match.group(0)
        syntax = re.fullmatch(r"'<[a-z ]+>'", quoted) or not re.search(r"[A-Za-z0-9]", quoted)
        return quoted if syntax else "(source text not shown)"

    return _QUOTED_RE.sub(keep, text)


def _yaml_problem(exc: yaml.YAMLError, text: str) -> str:
    """` line:column: not valid YAML: problem (context at line:column)`, built from the marks' numbers and
    PyYAML's problem and context, never str(exc): that quotes the offending line (its snippet)."""
    if isinstance(exc, yaml.reader.ReaderError):
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        return f"{line}:{column}: not valid YAML: character #x{exc.character:04x} is not allowed"
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"{mark.line + 1}:{mark.column + 1}:" if mark is not None else ""
        problem = _redact_quoted(exc.problem or "syntax error")
        if exc.context:
            context = _redact_quoted(exc.context)
            cmark = exc.context_mark
            problem += f" ({context} at {cmark.line + 1}:{cmark.column + 1})" if cmark is not None else f" ({context})"
        return f"{where} not valid YAML: {problem}"
    return " not valid YAML"
