"""The credentials the gateway sends upstream, one per model with `upstream_auth` (vLLM's --api-key).

A value comes from an environment variable (read once, when the config is loaded) or a file, which
is re-read when its mtime, size or inode changes (a Kubernetes Secret is swapped by a symlink), so a
rotation needs no restart. This is the request path: a file is stat'ed at most once per
`check_every` seconds on the injected clock, and read only when it changed.

Values never appear in logs, reprs or errors: only the env name or the file path do.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from modeldock.clock import Clock
from modeldock.config import UpstreamAuthConfig

log = logging.getLogger("modeldock.extproc")

CHECK_EVERY_SECONDS = 1.0


class UpstreamCredential:
    """One model's credential: `header` and `value()` (the full header value, or None when unavailable)."""

    __slots__ = ("header", "source", "_scheme", "_clock", "_check_every", "_path", "_value", "_stamp",
                 "_checked_at", "_problem")

    def __init__(self, auth: UpstreamAuthConfig, clock: Clock, *, check_every: float = CHECK_EVERY_SECONDS,
                 environ: Mapping[str, str] = os.environ) -> None:
        self.header = auth.header
        self._scheme = auth.scheme
        self._clock = clock
        self._check_every = check_every
        self._path = auth.file
        self._value: str | None = None
        self._stamp: tuple[int, int, int] | None = None
        self._checked_at = float("-inf")
        self._problem = ""  # why there is no value (names the source, never a secret)
        if auth.env is not None:
            self.source = f"environment variable {auth.env}"
            self._set(environ.get(auth.env, ""))
        else:
            self.source = f"file {auth.file}"

    def __repr__(self) -> str:
        return f"UpstreamCredential({self.header}, {self.source})"

    def value(self) -> str | None:
        if self._path is not None:
            now = self._clock.monotonic()
            if now - self._checked_at >= self._check_every:
                self._checked_at = now
                self._reload(self._path)
        return self._value

    @property
    def problem(self) -> str:
        """Why `value()` is None (for the log)."""
        return self._problem or f"{self.source} is empty"

    def _reload(self, path: str) -> None:
        try:
            st = os.stat(path)  # follows the symlink a mounted Secret swaps
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._stamp:
                return
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except (OSError, UnicodeDecodeError) as exc:
            if self._stamp != (-1, -1, -1):
                log.warning("upstream credential %s cannot be read: %s", self.source, type(exc).__name__)
            self._stamp, self._value = (-1, -1, -1), None
            self._problem = f"{self.source} cannot be read ({type(exc).__name__})"
            return
        self._stamp = stamp
        had = self._value is not None
        self._set(text)
        if had or self._value is not None:
            log.info("upstream credential %s (re)loaded%s", self.source, "" if self._value else ": empty")

    def _set(self, secret: str) -> None:
        secret = secret.strip()  # a file's trailing newline is not part of the key
        if not secret or any(c in secret for c in "\r\n\0"):
            self._value = None
            self._problem = f"{self.source} is empty" if not secret else f"{self.source} holds more than one line"
            return
        self._problem = ""
        self._value = f"{self._scheme} {secret}" if self._scheme else secret
