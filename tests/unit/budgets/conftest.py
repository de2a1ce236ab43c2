from __future__ import annotations

# One real-Redis fixture for both rooms' tests (budgets sit above request limits, as in modeldock/).
from tests.unit.admission.conftest import redis_server

__all__ = ["redis_server"]
