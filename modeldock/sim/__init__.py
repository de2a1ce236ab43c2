"""A vLLM-like inference simulator for the demo, the end-to-end tests and the benchmarks.

See README.md in this directory for the model of time, the KV cache and the test hooks.
"""

from modeldock.sim.config import SimConfig
from modeldock.sim.engine import Engine, StepResult, TokenOut
from modeldock.sim.server import Simulator, start_simulator

__all__ = ["Engine", "SimConfig", "Simulator", "StepResult", "TokenOut", "start_simulator"]
