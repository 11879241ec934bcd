"""The server's ``/metrics``: the engine's Prometheus registry (``kvserve.engine.prometheus``),
re-exported under the names the API server and its tests use."""

from kvserve.engine.prometheus import CONTENT_TYPE, PREFIX, VLLM_ALIASES, ServerMetrics

__all__ = ["CONTENT_TYPE", "PREFIX", "VLLM_ALIASES", "ServerMetrics"]
