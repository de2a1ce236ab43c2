"""The gateway's domain: one request's route from head and body to endpoints (see director.py)."""

from modeldock.gateway.director import COMPLETION_PATHS, MODELS_PATH, Gateway, check_route
from modeldock.gateway.routed import Finished, Routed

__all__ = ["COMPLETION_PATHS", "MODELS_PATH", "Finished", "Gateway", "Routed", "check_route"]
