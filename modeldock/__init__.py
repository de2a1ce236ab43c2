"""modeldock: an LLM inference gateway built as a Python control plane for Envoy."""

__version__ = "0.1.0"
