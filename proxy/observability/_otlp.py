"""One OTLP receiver's pipeline, in the export process: recorded calls (and rewards) as spans, sent by the SDK.

    call recorded --> _CallSpan (ids, times, status; attributes rendered later) --> gate (bounded: count, bytes)
        --> BatchSpanProcessor (its thread, its batches) --> _Counting --> OTLPSpanExporter (HTTP/protobuf, retries)

The SDK does the batching, the encoding (``opentelemetry-proto``), the HTTP with its retries and the
``OTEL_EXPORTER_OTLP_*`` variables. What tracetrain adds is what its operators need:

- the proxy learns of a call once it has finished, so a span is built finished, from the record, with the
  call's own start and end (``_CallSpan``, the SDK's ``ReadableSpan``), never through a tracer;
- its attributes are rendered when the exporter encodes the span, in the processor's thread;
- a gate before the processor bounds the queue by count and by bytes (the span keeps the call's request
  and response alive) and counts what it drops, where the SDK's processor drops silently;
- ``_Counting`` around the exporter counts what was sent, refused by the receiver (a 4xx, or spans
  rejected in an OTLP partial success) and given up (no answer, or 5xx after the SDK's retries);
- ``_Session`` (a ``requests.Session``) reads partial successes and, for a receiver with headers of its own
  (Langfuse), sends only those: the variables' headers, meant for the collector, never reach it.

It runs in the export process (``_export_process``), never in the proxy's, so a slow or dead receiver
costs exports, never a call, and the encoding's CPU never holds the proxy's interpreter.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import orjson
import requests
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util.types import Attributes

from proxy.observability._export_wire import ExportConfig
from proxy.observability._genai import (
    EVALUATION_EVENT,
    AttributeValue,
    estimated_bytes,
    evaluation_attributes,
    reward_scores,
    span_id,
    span_name,
    trace_id,
)
from store import CallWrite, redact

log = logging.getLogger("tracetrain.export")

Render = Callable[[CallWrite], Mapping[str, AttributeValue]]
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_SCOPE = InstrumentationScope("tracetrain")
_WARN_EVERY_S = 60.0


@dataclass(frozen=True, slots=True)
class Receiver:
    """Where spans go and how they read there.

    ``headers`` None: the standard variables' (``OTEL_EXPORTER_OTLP_TRACES_HEADERS``, ``..._HEADERS``);
    given: only these are sent. ``rewards``: rewards become spans in their trajectory's trace (a receiver
    that takes them otherwise, Langfuse's scores, says False).
    """

    name: str  # the metrics label and the log's
    endpoint: str  # the full traces URL, .../v1/traces
    render: Render
    headers: Mapping[str, str] | None = None
    rewards: bool = True
    gzip: bool = False


class _CallSpan(ReadableSpan):
    """A recorded call as a finished span: ids, times and status now; attributes when first read (encoding)."""

    def __init__(self, write: CallWrite, render: Render, resource: Resource) -> None:
        call = write.call
        start = round(float(call["started_at"]) * 1e9)
        failed = call["status_code"] != 200
        super().__init__(
            span_name(write),
            SpanContext(trace_id(write.trajectory_id), span_id(str(call["id"])), is_remote=False, trace_flags=_SAMPLED),
            resource=resource,
            kind=SpanKind.CLIENT,
            status=Status(StatusCode.ERROR, redact(call["error"] or "")) if failed else Status(StatusCode.UNSET),
            start_time=start,
            end_time=start + round(float(call["latency_ms"]) * 1e6),
            instrumentation_scope=_SCOPE,
        )
        self._write: CallWrite | None = write
        self._render = render
        self._rendered: Attributes = None
        self.size = estimated_bytes(call)

    @property
    def attributes(self) -> Attributes:
        if self._write is not None:
            self._rendered = MappingProxyType(dict(self._render(self._write)))
            self._write = None  # rendered: the record may go
        return self._rendered


def reward_span(reward: Mapping[str, Any], resource: Resource) -> ReadableSpan:
    """A reward as an instant span in its trajectory's trace, one ``gen_ai.evaluation.result`` event per score."""
    trajectory_id = str(reward["trajectory_id"])
    at = round(float(reward.get("created_at") or time.time()) * 1e9)
    explanation = str(reward["explanation"]) if reward.get("explanation") else None
    events = [
        Event(EVALUATION_EVENT, evaluation_attributes(name, value, explanation if i == 0 else None), at)
        for i, (name, value) in enumerate(reward_scores(reward))
    ]
    attributes = {
        "tracetrain.trajectory.id": trajectory_id,
        "tracetrain.group.id": str(reward.get("group_id") or ""),
        "tracetrain.reward.source": str(reward.get("source") or "service"),
        "gen_ai.conversation.id": trajectory_id,
    }
    seed = f"reward:{trajectory_id}:{at}:{reward.get('source')}:{reward.get('reward')}"
    return ReadableSpan(
        "reward",
        SpanContext(trace_id(trajectory_id), span_id(seed), is_remote=False, trace_flags=_SAMPLED),
        resource=resource,
        attributes=attributes,
        events=events,
        kind=SpanKind.INTERNAL,
        start_time=at,
        end_time=at,
        instrumentation_scope=_SCOPE,
    )


class OtlpExport:
    """One receiver's pipeline and its counters (items: spans), for ``/metrics``.

    - ``sent``: accepted by the receiver; ``rejected``: refused (a 4xx, or rejected in a partial success);
    - ``failed``: given up (no answer, or 5xx/429 through the SDK's retries);
    - ``dropped``: never sent: the queue was full (by count or bytes), or shutdown ran out of time;
    - ``queued`` and ``queued_bytes``: waiting now.
    """

    def __init__(self, receiver: Receiver, config: ExportConfig, resource: Resource) -> None:
        self.receiver, self.config, self._resource = receiver, config, resource
        self.dropped = 0
        self._handed = self._handed_bytes = 0  # to the processor, since start
        self._counting = _Counting(receiver, config)
        self._processor = BatchSpanProcessor(
            self._counting, max_queue_size=config.max_queue + 1,  # never full: the gate below drops first
            schedule_delay_millis=config.flush_interval_s * 1000,
            max_export_batch_size=min(config.batch_size, config.max_queue),
        )  # fmt: skip
        self._closed = False
        self._warned_at = -_WARN_EVERY_S

    @property
    def queued(self) -> int:
        return self._handed - self._counting.taken

    @property
    def queued_bytes(self) -> int:
        return self._handed_bytes - self._counting.taken_bytes

    def stats(self) -> dict[str, int]:
        c = self._counting
        return {"queued": self.queued, "queued_bytes": self.queued_bytes, "sent": c.sent,
                "dropped": self.dropped + c.dropped, "rejected": c.rejected, "failed": c.failed}  # fmt: skip

    # -- the request path: never blocks ---------------------------------------------------------------------

    def call_recorded(self, write: CallWrite) -> None:
        self._emit(_CallSpan(write, self.receiver.render, self._resource))

    def rewards_recorded(self, rewards: Sequence[Mapping[str, Any]]) -> None:
        if self.receiver.rewards:
            for reward in rewards:
                self._emit(reward_span(reward, self._resource))

    def _emit(self, span: ReadableSpan) -> None:
        size = getattr(span, "size", 1024)
        full = self.queued >= self.config.max_queue or self.queued_bytes + size > self.config.max_queue_bytes
        if self._closed or full:
            self.dropped += 1
            now = time.monotonic()
            if now - self._warned_at >= _WARN_EVERY_S:
                self._warned_at = now
                log.warning("%s export queue full: dropping spans (%d dropped so far)", self.receiver.name,
                            self.dropped)  # fmt: skip
            return
        self._handed += 1
        self._handed_bytes += size
        self._processor.on_end(span)

    # -- shutdown ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Send what is queued within ``shutdown_timeout_s`` (the rest counts as dropped), then stop (blocks).

        The processor's shutdown exports what is queued; past the time limit the exporter is shut, which
        ends its retries, and what is left is counted and dropped. An export stuck in a request beyond that
        is left to its daemon thread and its own timeout.
        """
        self._closed = True
        limit = self.config.shutdown_timeout_s
        self._counting.deadline = time.monotonic() + limit
        stopping = threading.Thread(target=self._processor.shutdown, name=f"{self.receiver.name}-export-shutdown",
                                    daemon=True)  # fmt: skip
        stopping.start()
        stopping.join(limit)
        if stopping.is_alive():
            self._counting.shutdown()
            stopping.join(1.0)
        left = self.queued
        if left:
            self.dropped += left
            self._handed -= left  # counted: no longer queued
            log.warning("%s export: %d spans not sent at shutdown (time limit reached)", self.receiver.name, left)


class _Counting(SpanExporter):
    """The SDK's OTLP exporter, counted: what was taken from the queue, sent, refused, given up, dropped."""

    def __init__(self, receiver: Receiver, config: ExportConfig) -> None:
        self.taken = self.taken_bytes = self.sent = self.rejected = self.failed = self.dropped = 0
        self.deadline: float | None = None  # set at shutdown: batches after it are dropped, not sent
        self._shut = False
        self._session = _Session(receiver.headers)
        self._exporter = OTLPSpanExporter(
            endpoint=receiver.endpoint,
            headers=dict(receiver.headers) if receiver.headers is not None else None,
            timeout=config.timeout_s,
            compression=Compression.Gzip if receiver.gzip else None,
            session=self._session,
        )

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        n = len(spans)
        self.taken += n
        self.taken_bytes += sum(getattr(s, "size", 1024) for s in spans)
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.dropped += n
            return SpanExportResult.FAILURE
        self._session.reset()
        result = self._exporter.export(spans)
        status = self._session.last_status
        if result is SpanExportResult.SUCCESS:
            rejected = min(n, self._session.rejected)
            self.sent += n - rejected
            self.rejected += rejected
        elif status is not None and 400 <= status < 500 and status != 429:
            self.rejected += n
        else:
            self.failed += n
        return result

    def shutdown(self) -> None:
        if not self._shut:
            self._shut = True
            self._exporter.shutdown()  # type: ignore[no-untyped-call]  # the SDK leaves it unannotated

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


class _Session(requests.Session):
    """The exporter's HTTP session: reads each answer's partial success; with ``only`` headers, sends no others."""

    # What any request carries: the body's description and the connection's.
    _TRANSPORT = frozenset({"content-type", "content-encoding", "content-length", "user-agent", "accept",
                            "accept-encoding", "connection"})  # fmt: skip

    def __init__(self, only: Mapping[str, str] | None) -> None:
        super().__init__()
        self._allowed = None if only is None else self._TRANSPORT | {k.lower() for k in only}
        self.hooks["response"].append(self._read)
        self.last_status: int | None = None
        self.rejected = 0

    def reset(self) -> None:
        self.last_status, self.rejected = None, 0

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        if self._allowed is not None:
            for name in [h for h in request.headers if h.lower() not in self._allowed]:
                del request.headers[name]
        return super().send(request, **kwargs)

    def _read(self, response: requests.Response, *args: Any, **kwargs: Any) -> None:
        self.last_status = response.status_code
        if response.status_code >= 300 or not response.content:
            return
        try:
            if "json" in response.headers.get("content-type", ""):
                partial = orjson.loads(response.content).get("partialSuccess") or {}
                self.rejected += int(partial.get("rejectedSpans") or 0)
            else:
                self.rejected += ExportTraceServiceResponse.FromString(response.content).partial_success.rejected_spans
        except Exception:  # an answer that is not OTLP: the spans were accepted, say nothing
            return
