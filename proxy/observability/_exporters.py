"""Every trace receiver of one app, behind the two calls the proxy makes: a call recorded, rewards written.

    Forwarder.record / record_nowait --> Exporters.call_recorded   --> the export process (spans)
    JobScheduler.rewards_written    --> Exporters.rewards_recorded --> reward spans there; Langfuse scores here

Receivers (``start_exporters``): an OpenTelemetry collector (``--otlp-endpoint``, or the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``), in the GenAI semantic
conventions (``_genai``), and Langfuse (``--langfuse``), in its own dialect (``_langfuse_wire``). Their
spans are built, encoded and sent by OpenTelemetry's SDK in a process of their own (``_export_process``:
why), each receiver with its own queue and thread, so a slow one never holds the other. This side keeps
a call's record in a list, hands the list over every 20 ms, and bounds what is handed but not yet taken
(by count and estimated bytes: beyond it calls are dropped and counted, receiver ``handoff``). Langfuse's
scores, a few per reward, are posted from here (``LangfuseScores``). The SDK is imported only when a
receiver is configured, and then only in the export process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from proxy._settings import Settings
from proxy.observability._export_process import Counters, ProcessConfig, run
from proxy.observability._export_wire import ExportConfig, call_tuple
from proxy.observability._genai import estimated_bytes
from proxy.observability._langfuse import LangfuseConfig, LangfuseScores
from store import CallWrite, redact

log = logging.getLogger("tracetrain.export")

_HAND_OVER_S = 0.02  # how often the batch of records goes to the export process
_BATCH = 256  # ... or as soon as it holds this many
_WARN_EVERY_S = 60.0


class Exporters:
    """The app's trace receivers; ``call_recorded`` and ``rewards_recorded`` only append, never wait.

    Counters by receiver (``stats``): each receiver's, as its pipeline counts them (``OtlpExport``), then
    ``handoff``: records not yet taken by the export process (``queued``, ``queued_bytes``) and those
    dropped because too many were (``dropped``), and ``langfuse_scores``.
    """

    def __init__(self, config: ProcessConfig, scores: LangfuseScores | None = None) -> None:
        self.config, self.scores = config, scores
        context = multiprocessing.get_context("spawn")  # never fork a process that runs threads
        self._inbox = context.Queue()
        self._counters: Counters = Counters(context.Array("q", Counters.size(config.receivers), lock=False),
                                            config.receivers)  # fmt: skip
        self._process = context.Process(target=run, args=(config, self._inbox, self._counters.array, os.getpid()),
                                         name="tracetrain-export", daemon=True)  # fmt: skip
        self._batch: list[tuple[Any, ...]] = []
        self._handed = self._handed_bytes = self.dropped = 0
        self._closing = False
        self._pump: asyncio.Task[None] | None = None
        self._warned_at: dict[str, float] = {}

    # -- the request path -----------------------------------------------------------------------------------

    def call_recorded(self, write: CallWrite) -> None:
        size = estimated_bytes(write.call)
        limits = self.config.export
        if self._closing or self.queued >= limits.max_queue or self.queued_bytes + size > limits.max_queue_bytes:
            self._drop(1)
            return
        self._batch.append(call_tuple(write))
        self._handed += 1
        self._handed_bytes += size
        if len(self._batch) >= _BATCH:
            self._hand_over()

    def rewards_recorded(self, rewards: Sequence[Mapping[str, Any]]) -> None:
        if not self._closing:
            self._put(("rewards", [dict(r) for r in rewards]), 0)
        if self.scores is not None:
            self.scores.rewards_recorded(rewards)

    # -- what is handed, and counted ------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return self._handed - self._counters.taken

    @property
    def queued_bytes(self) -> int:
        return self._handed_bytes - self._counters.taken_bytes

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters by receiver (``otlp``, ``langfuse``, ``handoff``, ``langfuse_scores``), for ``/metrics``."""
        out = {name: self._counters.receiver(name) for name in self.config.receivers}
        out["handoff"] = {"queued": self.queued, "queued_bytes": self.queued_bytes, "dropped": self.dropped}
        if self.scores is not None:
            out["langfuse_scores"] = self.scores.stats()
        return out

    def _hand_over(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self._put(("calls", batch), len(batch))

    def _put(self, message: tuple[str, Any], calls: int) -> None:
        if not self._process.is_alive():
            self._drop(calls, "the export process is gone (see its log above; a script that builds the app itself "
                       "must run it under `if __name__ == '__main__':`); dropping spans")  # fmt: skip
            return
        self._inbox.put_nowait(message)  # unbounded: the count and byte bounds above hold it

    def _drop(self, calls: int, why: str = "export queue full: dropping spans") -> None:
        self.dropped += calls
        now = time.monotonic()
        if calls and now - self._warned_at.get(why, -_WARN_EVERY_S) >= _WARN_EVERY_S:  # each reason once a minute
            self._warned_at[why] = now
            log.warning("%s (%d dropped so far)", why, self.dropped)

    # -- start and stop -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the export process and the hand-over beat (inside a running event loop)."""
        self._process.start()
        self._pump = asyncio.get_running_loop().create_task(self._beat(), name="tracetrain-export-handover")
        if self.scores is not None:
            self.scores.start()

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(_HAND_OVER_S)
            self._hand_over()

    async def aclose(self) -> None:
        """Hand over what is left, let the export process send it within its time limit, then stop it."""
        self._closing = True
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        self._hand_over()
        closing = [asyncio.to_thread(self._stop_process)]
        if self.scores is not None:
            closing.append(self.scores.aclose())
        await asyncio.gather(*closing)
        if left := self.queued:
            self._handed -= left  # counted: no longer queued
            self._drop(left, "the export process stopped before taking every span")

    def _stop_process(self) -> None:
        if self._process.is_alive():
            self._inbox.put_nowait(None)
            self._process.join(self.config.export.shutdown_timeout_s + 5.0)
        if self._process.is_alive():
            log.warning("the export process did not stop in time; ending it")
            self._process.terminate()
            self._process.join(5.0)
            self._inbox.cancel_join_thread()  # what its pipe still holds is lost: do not wait to write it
        self._inbox.close()


def start_exporters(settings: Settings, config: ExportConfig | None = None) -> Exporters | None:
    """The receivers the settings name, started; None when there are none (call inside the app's lifespan)."""
    if not (settings.otlp_endpoint or settings.langfuse):
        return None
    langfuse = scores = None
    if settings.langfuse:
        assert settings.langfuse_public_key and settings.langfuse_secret_key  # Settings checks it
        langfuse = LangfuseConfig(settings.langfuse_public_key, settings.langfuse_secret_key,
                                  settings.langfuse_base_url)  # fmt: skip
        scores = LangfuseScores(langfuse)
        log.info("exporting trajectories to Langfuse at %s", redact(langfuse.base_url))
    if settings.otlp_endpoint:
        what = "with" if settings.otlp_content else "without"
        log.info("exporting traces over OTLP to %s (%s messages)", redact(settings.otlp_endpoint), what)
    level = logging.getLogger("tracetrain").getEffectiveLevel()
    process = ProcessConfig(settings.otlp_endpoint, settings.otlp_content, langfuse, config or ExportConfig(), level)
    exporters = Exporters(process, scores)
    exporters.start()
    return exporters
