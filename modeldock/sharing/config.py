"""The `sharing:` section: how replicas share their load state through Redis (modeldock/sharing).

Imports pydantic only: `modeldock.config` mounts it.
"""

from __future__ import annotations

import os
import socket
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SharingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # None: on whenever a Redis is configured (limits.redis_url or $REDIS_URL); false: each replica its own view.
    enabled: bool | None = None
    # How often each replica publishes its holdings and reads its peers' (one Redis round trip).
    interval_ms: Annotated[int, Field(ge=20, le=2000)] = 100
    # A pick or a release here brings the next exchange forward (its peers hear of it within a round
    # trip or so, not an interval), but never closer than this to the last one.
    min_gap_ms: Annotated[int, Field(ge=1, le=1000)] = 5
    # ...when its endpoint is at least this full (requests of its batch limit, or committed tokens of
    # its KV capacity), or a peer has requests queued: only then can a peer's next decision turn on
    # it. Below, the peers hear of it at the next interval. 0: every pick and release at once.
    push_above: Annotated[float, Field(ge=0, le=1)] = 0.5
    # A replica not heard from for this long is forgotten; with Redis unreachable this long, each
    # replica falls back to its own view.
    ttl_ms: Annotated[int, Field(ge=200, le=30_000)] = 2000
    # One exchange's bound: a slower Redis counts as a failed exchange.
    timeout_ms: Annotated[int, Field(ge=1, le=2000)] = 100
    # Each endpoint's page is read on the cadence by one replica (rendezvous over the live ones) and
    # relayed to the others in its share: N replicas cost one replica's scraping. false: each reads all.
    split_scraping: bool = True
    # This replica's name among its peers; default $MODELDOCK_REPLICA, else host name and process id.
    replica: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")] | None = None

    @model_validator(mode="after")
    def _ttl_covers_exchanges(self) -> SharingConfig:
        if self.ttl_ms < 2 * self.interval_ms:
            raise ValueError("ttl_ms must be at least twice interval_ms (a replica would be forgotten "
                             "between two of its own exchanges)")
        if self.min_gap_ms > self.interval_ms:
            raise ValueError("min_gap_ms must be at most interval_ms")
        if self.timeout_ms > self.interval_ms * 2:
            raise ValueError("timeout_ms must be at most twice interval_ms")
        return self

    def replica_name(self) -> str:
        return self.replica or os.environ.get("MODELDOCK_REPLICA") or f"{socket.gethostname()}-{os.getpid()}"
