"""An OTLP/HTTP receiver on loopback, as a collector (or Langfuse) would be: it decodes what it gets.

Trace exports (``POST .../v1/traces``, protobuf, gzipped or not) are decoded with ``opentelemetry-proto``'s
``ExportTraceServiceRequest``; any other POST body (Langfuse's score lists) is kept as JSON. Each request is
answered as the test says: a status and body (``answer``), held open until released (``hang``), or not at
all (``stop``: the port then refuses connections).

Run as a script (``python tests/otlp_receiver.py --host H --port P``), it answers every export with 200 and
counts what it decoded, at ``GET /count``: what ``bench/proxy_overhead.py`` exports to.
"""

from __future__ import annotations

import argparse
import gzip
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span


@dataclass
class Received:
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes  # decompressed
    spans: list[Span] = field(default_factory=list)
    resource: dict[str, Any] = field(default_factory=dict)  # of the first resource

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Answer:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/x-protobuf"

    @classmethod
    def rejecting(cls, spans: int) -> Answer:
        """An OTLP partial success: ``spans`` of the request's spans rejected."""
        partial = ExportTracePartialSuccess(rejected_spans=spans, error_message="too old")
        return cls(200, ExportTraceServiceResponse(partial_success=partial).SerializeToString())


def value(v: AnyValue) -> Any:
    """An OTLP attribute value as Python."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return attributes(v.kvlist_value.values)
    return getattr(v, kind) if kind else None


def attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in pairs}


def decode(body: bytes) -> tuple[list[Span], dict[str, Any]]:
    request = ExportTraceServiceRequest.FromString(body)
    spans = [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]
    resource = attributes(request.resource_spans[0].resource.attributes) if request.resource_spans else {}
    return spans, resource


class OtlpReceiver:
    """The receiver, serving in a thread. ``answer`` may be one ``Answer`` or a function of the request."""

    def __init__(self) -> None:
        self.received: list[Received] = []  # answered with a success
        self.attempts: list[Received] = []  # every request, whatever its answer
        self.answer: Answer | Callable[[Received], Answer] = Answer()
        self._released = threading.Event()
        self._released.set()
        self.entered = threading.Event()  # a request arrived (set even while it hangs)
        self._server: ThreadingHTTPServer | None = None
        self.url = ""

    # -- what arrived ------------------------------------------------------------------------------------------

    def spans(self, path_suffix: str = "/v1/traces") -> list[Span]:
        return [s for r in list(self.received) if r.path.endswith(path_suffix) for s in r.spans]

    def requests_to(self, path_suffix: str) -> list[Received]:
        return [r for r in list(self.received) if r.path.endswith(path_suffix)]

    # -- how it answers ----------------------------------------------------------------------------------------

    def hang(self) -> None:
        """Hold every request open until ``release``."""
        self._released.clear()

    def release(self) -> None:
        self._released.set()

    def start(self, port: int = 0) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                if (self.headers.get("content-encoding") or "").lower() == "gzip":
                    raw = gzip.decompress(raw)
                got = Received(self.path, {k.lower(): v for k, v in self.headers.items()}, raw)
                if self.path.endswith("/v1/traces"):
                    got.spans, got.resource = decode(raw)
                receiver.attempts.append(got)
                receiver.entered.set()
                receiver._released.wait()
                answer = receiver.answer(got) if callable(receiver.answer) else receiver.answer
                if answer.status < 300:
                    receiver.received.append(got)
                self.send_response(answer.status)
                self.send_header("content-type", answer.content_type)
                self.send_header("content-length", str(len(answer.body)))
                self.end_headers()
                self.wfile.write(answer.body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True).start()

    def stop(self) -> None:
        """Close the port: connections are refused from now on."""
        self._released.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    receiver.start()
    try:
        yield receiver
    finally:
        receiver.stop()


def wait_until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def _serve_counting(host: str, port: int) -> None:
    """The bench's sink: 200 to every export, ``GET /count`` says what was decoded (spans by path)."""
    counts: dict[str, Any] = {"requests": 0, "bytes": 0, "spans": {}}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
            size = len(raw)
            if (self.headers.get("content-encoding") or "").lower() == "gzip":
                raw = gzip.decompress(raw)
            spans = len(decode(raw)[0]) if self.path.endswith("/v1/traces") else 0
            with lock:
                counts["requests"] += 1
                counts["spans"][self.path] = counts["spans"].get(self.path, 0) + spans
                counts["bytes"] += size
            self._reply(b"", "application/x-protobuf")

        def do_GET(self) -> None:
            with lock:
                body = json.dumps(counts).encode()
            self._reply(body, "application/json")

        def _reply(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    ThreadingHTTPServer((host, port), Handler).serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="An OTLP/HTTP sink that counts the spans it decodes.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    _serve_counting(args.host, args.port)


__all__ = ["Answer", "KeyValue", "OtlpReceiver", "Received", "attributes", "otlp_receiver", "value", "wait_until"]
