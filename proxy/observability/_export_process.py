"""The export process: the OTLP receivers' pipelines, run apart from the proxy's event loop.

    proxy process                                   export process (multiprocessing, spawned)
    Exporters.call_recorded -> batch (20 ms) -> Queue -> run() -> OtlpExport per receiver -> collector, Langfuse
                         <- counters (shared memory) <-

Why a process of its own: OpenTelemetry's Python encoder builds each span's protobuf attribute by
attribute, tens of microseconds a span, and a batch of 512 holds the GIL for tens of milliseconds.
In the proxy's process that thread took the GIL from the event loop: measured with both receivers on,
+48 ms on p99 at concurrency 1 and a third less throughput at 64 (docs/BENCHMARKS.md). Here the SDK
runs as it is meant to, and the proxy's part of a call is appending a tuple to a list; its batches
are pickled by the queue's own thread.

The counters live in shared memory (``Counters``): the proxy reads them for ``/metrics`` without
asking. The process leaves when told (``None``), or when the proxy that started it is gone.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from proxy.observability._export_wire import ExportConfig, quiet_sdk_logs, write_of
from proxy.observability._genai import call_attributes, estimated_bytes
from proxy.observability._langfuse import LangfuseConfig
from proxy.observability._langfuse_wire import TRACES_PATH, generation_attributes
from store import without_userinfo

if TYPE_CHECKING:  # the SDK is imported in the export process only
    from proxy.observability._otlp import OtlpExport, Receiver

log = logging.getLogger("tracetrain.export")

OUTCOMES = ("queued", "queued_bytes", "sent", "dropped", "rejected", "failed")
_STATS_EVERY_S = 0.2
_PARENT_CHECK_S = 1.0

Message = tuple[str, Any]  # ("calls", [call tuple, ...]) | ("rewards", [reward, ...]); None: stop


@dataclass(frozen=True, slots=True)
class ProcessConfig:
    """What the export process builds its receivers from (picklable: it crosses to the new process)."""

    otlp_endpoint: str | None
    otlp_content: bool
    langfuse: LangfuseConfig | None
    export: ExportConfig
    log_level: int = logging.INFO

    @property
    def receivers(self) -> list[str]:
        return [name for name, on in (("otlp", self.otlp_endpoint), ("langfuse", self.langfuse)) if on]


class Counters:
    """Shared memory: calls the process took from the queue (and their estimated bytes), then each
    receiver's ``OUTCOMES``, in ``ProcessConfig.receivers``' order."""

    def __init__(self, array: Any, receivers: Sequence[str]) -> None:  # a ctypes array of int64 in shared memory
        self.array, self.receivers = array, list(receivers)

    @staticmethod
    def size(receivers: Sequence[str]) -> int:
        return 2 + len(OUTCOMES) * len(receivers)

    @property
    def taken(self) -> int:
        return int(self.array[0])

    @property
    def taken_bytes(self) -> int:
        return int(self.array[1])

    def took(self, calls: int, estimated_bytes: int) -> None:
        self.array[0] += calls
        self.array[1] += estimated_bytes

    def receiver(self, name: str) -> dict[str, int]:
        at = 2 + len(OUTCOMES) * self.receivers.index(name)
        return {outcome: int(self.array[at + i]) for i, outcome in enumerate(OUTCOMES)}

    def write(self, name: str, stats: dict[str, int]) -> None:
        at = 2 + len(OUTCOMES) * self.receivers.index(name)
        for i, outcome in enumerate(OUTCOMES):
            self.array[at + i] = stats[outcome]


def langfuse_receiver(config: LangfuseConfig) -> Receiver:
    """Langfuse as a receiver of the OTLP export: its endpoint, its headers only, its dialect of attributes."""
    from proxy.observability._otlp import Receiver

    headers = {"Authorization": config.basic_auth(), "x-langfuse-ingestion-version": "4"}
    endpoint = without_userinfo(config.base_url).rstrip("/") + TRACES_PATH  # the keys authenticate; URLs get logged
    return Receiver("langfuse", endpoint, generation_attributes, headers,
                    rewards=False, gzip=True)  # fmt: skip


def build_receivers(config: ProcessConfig) -> list[Receiver]:
    from proxy.observability._otlp import Receiver

    receivers = []
    if config.otlp_endpoint:
        receivers.append(Receiver("otlp", config.otlp_endpoint, partial(call_attributes, content=config.otlp_content)))
    if config.langfuse is not None:
        receivers.append(langfuse_receiver(config.langfuse))
    return receivers


def run(config: ProcessConfig, inbox: Any, array: Any, parent: int) -> None:
    """The export process's main: take batches until told to stop, then send what is queued and leave."""
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from opentelemetry.sdk.resources import Resource

    from proxy.observability._otlp import OtlpExport

    quiet_sdk_logs()
    resource = Resource.create({"service.name": "tracetrain"})  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES apply
    exports = [OtlpExport(receiver, config.export, resource) for receiver in build_receivers(config)]
    counters = Counters(array, config.receivers)
    done = threading.Event()
    publisher = threading.Thread(target=_publish, args=(exports, counters, done), name="export-stats", daemon=True)
    publisher.start()
    try:
        _take(inbox, exports, counters, parent)
    finally:
        closing = [threading.Thread(target=e.close, name=f"{e.receiver.name}-close") for e in exports]
        for thread in closing:
            thread.start()
        for thread in closing:
            thread.join()
        done.set()
        publisher.join()


def _take(inbox: Any, exports: list[OtlpExport], counters: Counters, parent: int) -> None:
    while True:
        try:
            message: Message | None = inbox.get(timeout=_PARENT_CHECK_S)
        except queue.Empty:
            if os.getppid() != parent:  # the proxy is gone without a word: nothing more will come
                return
            continue
        if message is None:
            return
        kind, items = message
        if kind == "calls":
            writes = [write_of(item) for item in items]
            for export in exports:
                for write in writes:
                    export.call_recorded(write)
            counters.took(len(writes), sum(estimated_bytes(w.call) for w in writes))
        elif kind == "rewards":
            for export in exports:
                export.rewards_recorded(items)


def _publish(exports: list[OtlpExport], counters: Counters, done: threading.Event) -> None:
    """Copy each receiver's counters to shared memory, every 0.2 s and once more at the end."""
    while True:
        stopping = done.wait(_STATS_EVERY_S)
        for export in exports:
            counters.write(export.receiver.name, export.stats())
        if stopping:
            return
