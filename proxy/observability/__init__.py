"""What the proxy tells operators: Prometheus metrics, disk usage, and the optional Langfuse export."""

from proxy.observability._langfuse import LangfuseExporter, start_langfuse
from proxy.observability._metrics import Metrics

__all__ = ["LangfuseExporter", "Metrics", "start_langfuse"]
