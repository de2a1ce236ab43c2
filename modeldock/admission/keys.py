"""API-key lookup: keys are stored only as SHA-256 hashes and compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from modeldock.config import TenantConfig
from modeldock.errors import Unauthorized


class KeyStore:
    """Maps key hashes to tenants. Immutable; build a new one to reload."""

    def __init__(self, tenants: Iterable[TenantConfig]) -> None:
        entries: list[tuple[bytes, TenantConfig]] = []
        for tenant in tenants:
            for stored in tenant.api_key_hashes:
                entries.append((bytes.fromhex(stored.removeprefix("sha256:")), tenant))
        self._entries = tuple(entries)

    def authenticate(self, key: str) -> TenantConfig:
        """Return the key's tenant, or raise Unauthorized. Never logs or echoes the key."""
        if not key:
            raise Unauthorized("Missing API key. Send it as `Authorization: Bearer <key>`.")
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        found: TenantConfig | None = None
        # Compare against every entry so the time taken does not depend on which one matches.
        for stored, tenant in self._entries:
            if hmac.compare_digest(stored, digest):
                found = tenant
        if found is None:
            raise Unauthorized("Incorrect API key provided.")
        return found
