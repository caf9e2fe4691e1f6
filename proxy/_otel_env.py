"""The trace export's endpoint as OpenTelemetry's standard variables name it, and its URL checked.

``tracetrain serve --otlp-endpoint`` (or ``TRACETRAIN_OTLP_ENDPOINT``) names the collector; without
either, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` do, as they would
for any instrumented app (unless ``OTEL_SDK_DISABLED`` or an ``OTEL_TRACES_EXPORTER`` without
``otlp``). The export speaks OTLP over HTTP (http/protobuf) only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlsplit


def endpoint_from_env(env: Mapping[str, str] = os.environ) -> str | None:
    """The traces URL OpenTelemetry's standard variables name, or None."""
    exporters = [e.strip() for e in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",")]
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or "otlp" not in exporters:
        return None
    if url := env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
        return url
    if url := env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        return url.rstrip("/") + "/v1/traces"
    return None


def traces_url(value: str | None, env: Mapping[str, str] = os.environ) -> str | None:
    """``value`` as the collector's traces URL (``/v1/traces`` added to a bare host); ValueError says what is wrong."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"the OTLP endpoint must be an http(s) URL such as http://collector:4318, got {value!r}")
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol and protocol.strip() != "http/protobuf":
        raise ValueError(
            f"tracetrain exports OTLP over HTTP (http/protobuf), not {protocol.strip()}: unset "
            "OTEL_EXPORTER_OTLP_PROTOCOL and point the endpoint at the collector's HTTP port (usually 4318)"
        )
    path = urlsplit(value).path
    return value.rstrip("/") + "/v1/traces" if path in ("", "/") else value
