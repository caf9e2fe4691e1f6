"""Every trace receiver of one app, behind the two calls the proxy makes: a call recorded, rewards written.

    Forwarder.record / record_nowait --> Exporters.call_recorded --> each OTLP receiver's queue
    JobScheduler.rewards_written    --> Exporters.rewards_recorded --> reward spans, Langfuse scores

Receivers (``start_exporters``): an OpenTelemetry collector (``--otlp-endpoint``, or the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``), in the GenAI semantic
conventions (``_genai``), and Langfuse (``--langfuse``), in its own dialect (``_langfuse_wire``), each
with its own queue and thread, so a slow one never holds the other. Both are the SDK's exporter, imported
only when a receiver is configured (it and ``requests`` add a quarter of a second to the proxy's start).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from proxy._settings import Settings
from store import CallWrite

if TYPE_CHECKING:
    from proxy.observability._langfuse import LangfuseScores
    from proxy.observability._otlp import ExportConfig, OtlpExport

log = logging.getLogger("tracetrain.export")

# The SDK's exporter logs every failed batch and every retry; during an outage that is a line a second.
_SDK_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "opentelemetry.sdk._shared_internal")


class Exporters:
    """The app's trace receivers; ``call_recorded`` and ``rewards_recorded`` only queue, never wait."""

    def __init__(self, exports: Sequence[OtlpExport], scores: LangfuseScores | None = None) -> None:
        self.exports = list(exports)
        self.scores = scores

    def call_recorded(self, write: CallWrite) -> None:
        light = slim(write)
        for export in self.exports:
            export.call_recorded(light)

    def rewards_recorded(self, rewards: Sequence[Mapping[str, Any]]) -> None:
        for export in self.exports:
            export.rewards_recorded(rewards)
        if self.scores is not None:
            self.scores.rewards_recorded(rewards)

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters by receiver (``otlp``, ``langfuse``, ``langfuse_scores``), for ``/metrics``."""
        out = {export.receiver.name: export.stats() for export in self.exports}
        if self.scores is not None:
            out["langfuse_scores"] = self.scores.stats()
        return out

    def start(self) -> None:
        if self.scores is not None:
            self.scores.start()

    async def aclose(self) -> None:
        """Send what is queued, each receiver within its time limit, together."""
        closing = [asyncio.to_thread(export.close) for export in self.exports]
        if self.scores is not None:
            closing.append(self.scores.aclose())
        await asyncio.gather(*closing)


# The fields of a call a span reads: the token ids, the big part of a record, are left behind.
_SPAN_FIELDS = (
    "id", "endpoint", "model", "served_model", "stream", "request", "response", "finish_reason", "prompt_tokens",
    "completion_tokens", "status_code", "error", "latency_ms", "ttft_ms", "started_at",
)  # fmt: skip


def slim(write: CallWrite) -> CallWrite:
    """The record with only what a span reads (not its token ids), so a queued span holds less."""
    call = write.call
    return CallWrite({k: call.get(k) for k in _SPAN_FIELDS}, write.trajectory_id, write.group_id, write.policy,
                     write.keyed_by, None, None, write.created_at, write.version)  # fmt: skip


def start_exporters(settings: Settings, config: ExportConfig | None = None) -> Exporters | None:
    """The receivers the settings name, started; None when there are none (call inside the app's lifespan)."""
    if not (settings.otlp_endpoint or settings.langfuse):
        return None
    from opentelemetry.sdk.resources import Resource

    from proxy.observability._genai import call_attributes
    from proxy.observability._langfuse import LangfuseConfig, LangfuseScores, langfuse_receiver
    from proxy.observability._otlp import ExportConfig, OtlpExport, Receiver

    config = config or ExportConfig()
    resource = Resource.create({"service.name": "tracetrain"})  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES apply
    exports: list[OtlpExport] = []
    scores = None
    if settings.otlp_endpoint:
        render = partial(call_attributes, content=settings.otlp_content)
        exports.append(OtlpExport(Receiver("otlp", settings.otlp_endpoint, render), config, resource))
        what = "with" if settings.otlp_content else "without"
        log.info("exporting traces over OTLP to %s (%s messages)", shown_url(settings.otlp_endpoint), what)
    if settings.langfuse:
        assert settings.langfuse_public_key and settings.langfuse_secret_key  # Settings checks it
        langfuse = LangfuseConfig(settings.langfuse_public_key, settings.langfuse_secret_key,
                                  settings.langfuse_base_url)  # fmt: skip
        exports.append(OtlpExport(langfuse_receiver(langfuse), config, resource))
        scores = LangfuseScores(langfuse)
        log.info("exporting trajectories to Langfuse at %s", shown_url(langfuse.base_url))
    for name in _SDK_LOGGERS:
        sdk_log = logging.getLogger(name)
        if not any(isinstance(f, _OncePerMinute) for f in sdk_log.filters):
            sdk_log.addFilter(_OncePerMinute())
    exporters = Exporters(exports, scores)
    exporters.start()
    return exporters


def shown_url(url: str) -> str:
    """A URL as it may be logged: without a password in it."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class _OncePerMinute(logging.Filter):
    """Lets each of a logger's messages (by its format string) through at most once a minute."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self._last.get(str(record.msg), -60.0) < 60.0:
            return False
        self._last[str(record.msg)] = now
        return True
