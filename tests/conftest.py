"""Suite-wide settings, the e2e marker on everything under tests/e2e/ (the fast tier leaves them out), and
the one fixture of a real Redis server for a test (`redis_server`; a module's own share one the same way)."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.redis_server import RedisServer

# Test processes hold live gRPC state while they start children with a preexec_fn
# (PR_SET_PDEATHSIG). gRPC's fork handlers then sometimes abort the child between
# fork and exec; the tests fork only to exec, so they need no fork support.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

E2E_DIR = Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A file under tests/e2e/ that forgets `pytestmark = pytest.mark.e2e` still stays out of `-m "not e2e"`.
    for item in items:
        if E2E_DIR in item.path.parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A real Redis of its own, on a free port, killed after the test (SIGKILL also ends a paused one)."""
    with RedisServer() as server:
        yield server
