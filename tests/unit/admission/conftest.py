from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.redis_server import RedisServer


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        server.start()
        yield server
    finally:
        server.resume()  # a test that paused it must not leave a stopped process
        server.close()
