"""What the proxy tells operators: Prometheus metrics, disk usage, and the optional trace export (OTLP, Langfuse)."""

from proxy.observability._exporters import Exporters, start_exporters
from proxy.observability._metrics import Metrics

__all__ = ["Exporters", "Metrics", "start_exporters"]
