"""The director on a FakeClock, without gRPC: a Gateway (`make_gateway`) with a picker that has room
saturation on, and requests routed as asyncio tasks. Shared by the director's queue tests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from modeldock.clock import FakeClock
from modeldock.gateway import Routed
from modeldock.gateway.request import RequestHead
from modeldock.picking import Picker, Saturation
from modeldock.types import Endpoint
from tests.support.extproc_messages import make_gateway


class GatewayRig:
    def __init__(self, config: dict[str, Any], endpoints: Sequence[Endpoint], model: str = "m") -> None:
        self.clock = FakeClock()
        self.gateway = make_gateway(config, {model: [ep.address for ep in endpoints]}, clock=self.clock,
                                    picker=lambda clock: Picker(clock, fallbacks=0, saturation=Saturation(room=True)))
        self.picker = self.gateway.picker
        self.admission = self.gateway.admission

    def send(self, key: str, body: dict[str, Any], request_id: str, priority: str = "") -> asyncio.Task[Routed]:
        """Route a request with `Bearer key` as a task (it may wait in the queue)."""
        head = RequestHead("POST", "/v1/chat/completions", (f"Bearer {key}",), None, request_id, priority)
        return asyncio.ensure_future(self.gateway.route(head, json.dumps(body).encode()))


async def settle() -> None:
    """Let the tasks that can run, run (a dispatch wakes a waiter a few steps later)."""
    for _ in range(5):
        await asyncio.sleep(0)
