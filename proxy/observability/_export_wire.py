"""What both sides of the trace export share: a receiver's bounds, a record as it crosses, the SDK's logs tamed.

The proxy's side (``_exporters``) and the export process (``_export_process``, which builds the OTLP
pipelines of ``_otlp``) each import this module and nothing of each other's, so the three import one way.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from store import CallWrite

# The SDK's exporter logs every failed batch and every retry; during an outage that is a line a second.
_SDK_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "opentelemetry.sdk._shared_internal")
# The fields of a call a span reads: the token ids, the big part of a record, are left behind.
_SPAN_FIELDS = (
    "id", "endpoint", "model", "served_model", "stream", "request", "response", "finish_reason", "prompt_tokens",
    "completion_tokens", "status_code", "error", "latency_ms", "ttft_ms", "started_at",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ExportConfig:
    """How much a receiver may hold and how it sends. A count and a byte bound: whichever comes first."""

    batch_size: int = 512  # spans per request (the SDK's default)
    flush_interval_s: float = 1.0  # the longest a span waits for its batch to fill
    max_queue: int = 4096  # spans held while the receiver is slow or down; beyond that they are dropped
    max_queue_bytes: int = 64 * 2**20  # an estimate of what those spans keep alive (requests, responses)
    # Per request, the SDK's retries included; None: OTEL_EXPORTER_OTLP_TRACES_TIMEOUT or OTEL_EXPORTER_OTLP_TIMEOUT
    # (seconds, as the Python SDK reads them), else 10.
    timeout_s: float | None = None
    shutdown_timeout_s: float = 5.0  # at shutdown, the time left to send what is queued


def call_tuple(write: CallWrite) -> tuple[Any, ...]:
    """What crosses to the export process of a recorded call: only what a span reads (no token ids)."""
    call = write.call
    return ({k: call.get(k) for k in _SPAN_FIELDS}, write.trajectory_id, write.group_id, write.policy,
            write.keyed_by, write.created_at, write.version)  # fmt: skip


def write_of(item: tuple[Any, ...]) -> CallWrite:
    """``call_tuple``'s record again, in the export process."""
    call, trajectory_id, group_id, policy, keyed_by, created_at, version = item
    return CallWrite(call, trajectory_id, group_id, policy, keyed_by, None, None, created_at, version)


def quiet_sdk_logs() -> None:
    """Let each of the SDK exporter's log lines through once a minute (it logs every failed try)."""
    for name in _SDK_LOGGERS:
        sdk_log = logging.getLogger(name)
        if not any(isinstance(f, _OncePerMinute) for f in sdk_log.filters):
            sdk_log.addFilter(_OncePerMinute())


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
