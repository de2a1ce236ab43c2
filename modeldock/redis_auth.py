"""Redis credentials from a file or an environment variable, and TLS options for a rediss:// URL.

Below the schema (floor 1, beside `redis_client`): `config` mounts `RedisAuthConfig` and calls
`auth_problem`; the client factory passes `connection_kwargs(auth, url)` to redis-py's pool. So:

- the password is never in the config or the URL: `PasswordProvider` reads the file (or the variable)
  each time redis-py opens a connection, so a rotated secret (a Kubernetes Secret's symlink swap, a
  rewritten file) takes effect at the next connection, with no restart; connections already
  authenticated stay so, as Redis keeps an authenticated session after ACL SETUSER changes its password;
- the secret is never logged, never in a repr, never in an error: errors name the file or the variable;
- `tls_server_name` is the name the server certificate is checked against (and sent as SNI) when the URL
  names the server by IP address; redis-py 8.2's asyncio SSLConnection has no option for it, hence
  `ServerNameSSLConnection`, which only adds `server_hostname` to asyncio's open_connection.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qsl, urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from redis.asyncio.connection import SSLConnection
from redis.credentials import CredentialProvider
from redis.exceptions import ConnectionError as RedisConnectionError

__all__ = [
    "TLS_FIELDS", "CredentialsUnavailable", "PasswordProvider", "RedisAuthConfig", "ServerNameSSLConnection",
    "auth_problem", "connection_kwargs",
]

_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A DNS name (labels of letters, digits and hyphens) or an IPv4/IPv6 literal: what a certificate's SAN holds.
_SERVER_NAME_RE = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.?)+|[0-9A-Fa-f:.]+")
TLS_SCHEMES = ("rediss", "rediss+sentinel")
TLS_FIELDS = ("tls_ca_file", "tls_cert_file", "tls_key_file", "tls_server_name", "tls_insecure_skip_verify")


def _readable_file(path: Path) -> Path:
    """The path, if it names a file this process can open now (a typo fails at load, not at the first
    connection). The message names the problem, never the contents."""
    if not str(path).strip():
        raise ValueError("must be a file path")
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, not a file")
    if path.exists() and not path.is_file():
        raise ValueError(f"{path}: is not a regular file")  # a FIFO would block the load
    try:
        with path.open("rb"):
            pass  # opening checks the permission; the contents are read where they are used
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    return path


ReadableFile = Annotated[Path, AfterValidator(_readable_file)]


class RedisAuthConfig(BaseModel):
    """`limits.redis_auth`: who to log in as and how to check the server. Fields are validated in the order
    declared, so a check across fields sits on the later one and its error names that field."""

    # The same base as config._Strict (unknown keys refused, frozen); this module sits below config, so it
    # cannot import it.
    model_config = ConfigDict(extra="forbid", frozen=True)

    password_file: ReadableFile | None = None  # re-read at every new connection; a trailing newline is dropped
    password_env: str | None = Field(default=None, validate_default=True)  # read at every new connection
    username: str | None = Field(default=None, validate_default=True)  # an ACL user; None: the default user
    tls_ca_file: ReadableFile | None = None  # None: the system's CAs
    tls_cert_file: ReadableFile | None = None  # a client certificate (tls-auth-clients yes), with its key
    tls_key_file: ReadableFile | None = Field(default=None, validate_default=True)
    tls_server_name: str | None = None  # checked against the certificate instead of the URL's host
    tls_insecure_skip_verify: bool = Field(default=False, validate_default=True)

    @field_validator("password_env")
    @classmethod
    def _password_env(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and not _ENV_NAME_RE.fullmatch(value):
            raise ValueError("must be an environment variable name (the variable holds the password)")
        if value is not None and info.data.get("password_file") is not None:
            raise ValueError("give one of password_file or password_env, not both")
        return value

    @field_validator("username")
    @classmethod
    def _username(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and (not value or any(c.isspace() or not c.isprintable() for c in value)):
            raise ValueError("must be a non-empty ACL user name without spaces")
        # Only when both were valid (a bad one is in its own error, not missing here).
        sources = [info.data.get(name, "invalid") for name in ("password_file", "password_env")]
        if value is not None and sources == [None, None]:
            raise ValueError("needs a password: give password_file or password_env")
        return value

    @field_validator("tls_key_file")
    @classmethod
    def _key_with_cert(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        cert = info.data.get("tls_cert_file")
        if cert is not None and value is None:
            raise ValueError("needed with tls_cert_file (the client certificate's private key)")
        if value is not None and cert is None and "tls_cert_file" in info.data:
            raise ValueError("given without tls_cert_file (the client certificate it belongs to)")
        return value

    @field_validator("tls_server_name")
    @classmethod
    def _server_name(cls, value: str | None) -> str | None:
        if value is not None and not _SERVER_NAME_RE.fullmatch(value):
            raise ValueError("must be a DNS name or an IP address, as in the server certificate")
        return value

    @field_validator("tls_insecure_skip_verify")
    @classmethod
    def _skip_verify(cls, value: bool, info: ValidationInfo) -> bool:
        # Verification off makes these settings do nothing; refusing the mix keeps a config from looking
        # checked when it is not.
        for field in ("tls_ca_file", "tls_server_name"):
            if value and info.data.get(field) is not None:
                raise ValueError(f"true turns off the certificate check that {field} configures; drop one")
        return value

    @property
    def has_password(self) -> bool:
        return self.password_file is not None or self.password_env is not None

    def tls_fields_set(self) -> tuple[str, ...]:
        """The TLS fields given a value (a rediss:// URL is needed for them)."""
        return tuple(name for name in TLS_FIELDS if getattr(self, name) not in (None, False))


def auth_problem(url: str, auth: RedisAuthConfig) -> str | None:
    """What is wrong with this auth for this Redis URL, starting with the field at fault, or None. For the
    config layer, after `redis_url_problem(url)` passed; the answer never quotes the URL."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "the Redis URL does not parse"
    scheme = parts.scheme.lower()
    tls = auth.tls_fields_set()
    if tls and scheme == "redis+sentinel":
        return f"{tls[0]}: TLS options need a rediss+sentinel:// URL (TLS to the Sentinels and the master)"
    if tls and scheme not in TLS_SCHEMES:
        return f"{tls[0]}: TLS options need a rediss:// URL (this one is {scheme}://)"
    if auth.has_password:
        field = "password_file" if auth.password_file is not None else "password_env"
        # redis-py refuses a URL's username or password together with a credential provider; saying so here
        # fails at load rather than at the first connection.
        query = {key.lower() for key, _ in parse_qsl(parts.query)}
        if parts.netloc.rpartition("@")[1] or query & {"username", "password"}:
            return f"{field}: the Redis URL also holds a username or password; give the credentials one way"
    return None


class CredentialsUnavailable(RedisConnectionError):
    """The password file or variable could not be read when a connection was opened. A redis-py
    ConnectionError, so the rooms count it as Redis unavailable and the next connection tries again."""


class PasswordProvider(CredentialProvider):
    """The username and the current password, read from the file or variable each time redis-py asks (once
    per new connection, so the cost is a small local read per connect, not per command)."""

    def __init__(self, *, username: str | None = None, password_file: Path | None = None,
                 password_env: str | None = None) -> None:
        if (password_file is None) == (password_env is None):
            raise ValueError("give exactly one of password_file or password_env")
        self.username = username
        self._file = password_file
        self._env = password_env

    @property
    def source(self) -> str:
        """Where the password comes from (a path or a variable's name: never the password)."""
        return f"file {self._file}" if self._file is not None else f"${self._env}"

    def password(self) -> str:
        if self._file is not None:
            try:
                text = self._file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
                raise CredentialsUnavailable(f"Redis password {self.source}: cannot be read ({reason})") from None
        else:
            assert self._env is not None
            text = os.environ.get(self._env, "")
        # `echo pw > file` and most secret stores end the value with a newline that is not part of it.
        password = text.rstrip("\r\n")
        if not password:
            # Also what a reader sees mid-rotation if the writer truncates before writing: failing this
            # connection (the next one reads again) is better than sending an empty AUTH.
            raise CredentialsUnavailable(f"Redis password {self.source}: is empty or not set")
        return password

    def get_credentials(self) -> tuple[str] | tuple[str, str]:
        password = self.password()
        return (self.username, password) if self.username else (password,)

    async def get_credentials_async(self) -> tuple[str] | tuple[str, str]:
        # A blocking read of a few bytes of a local file, once per new connection: cheaper than a thread hop,
        # and redis-py's base method would log a warning on every call.
        return self.get_credentials()

    def __repr__(self) -> str:  # redis-py's pool repr shows its connection kwargs, this object among them
        return f"PasswordProvider(username={self.username!r}, source={self.source!r})"

    __str__ = __repr__



class ServerNameSSLConnection(SSLConnection):
    """redis-py's asyncio TLS connection that checks the server certificate against (and sends as SNI)
    `ssl_server_name` instead of the host it dials: asyncio's open_connection takes `server_hostname`,
    redis-py 8.2 passes none, so the name would always be the URL's host."""

    def __init__(self, *, ssl_server_name: str | None = None, **kwargs: Any) -> None:
        self.ssl_server_name = ssl_server_name
        super().__init__(**kwargs)

    def _connection_arguments(self) -> Mapping[str, Any]:
        arguments = dict(super()._connection_arguments())
        if self.ssl_server_name:
            arguments["server_hostname"] = self.ssl_server_name
        return arguments


def connection_kwargs(auth: RedisAuthConfig | None, url: str) -> dict[str, Any]:
    """The keyword arguments for redis-py's `ConnectionPool.from_url(url, ...)` (or a Sentinel's
    `master_for`) that apply `auth`; {} without it. ValueError if `auth_problem` finds one.

    Options in the URL's query (`?ssl_cert_reqs=none`) win over these: redis-py's from_url applies them last.
    """
    if auth is None:
        return {}
    problem = auth_problem(url, auth)
    if problem is not None:
        raise ValueError(problem)
    kwargs: dict[str, Any] = {}
    if auth.has_password:
        kwargs["credential_provider"] = PasswordProvider(
            username=auth.username, password_file=auth.password_file, password_env=auth.password_env)
    if urlsplit(url).scheme.lower() not in TLS_SCHEMES:
        return kwargs
    if auth.tls_insecure_skip_verify:
        kwargs["ssl_cert_reqs"] = "none"
        kwargs["ssl_check_hostname"] = False
    else:
        kwargs["ssl_cert_reqs"] = "required"
        kwargs["ssl_check_hostname"] = True
    if auth.tls_ca_file is not None:
        kwargs["ssl_ca_certs"] = str(auth.tls_ca_file)
    if auth.tls_cert_file is not None:
        kwargs["ssl_certfile"] = str(auth.tls_cert_file)
        kwargs["ssl_keyfile"] = str(auth.tls_key_file)
    if auth.tls_server_name is not None:
        # from_url keeps a connection_class passed in (it would pick SSLConnection for rediss:// otherwise).
        kwargs["connection_class"] = ServerNameSSLConnection
        kwargs["ssl_server_name"] = auth.tls_server_name
    return kwargs
