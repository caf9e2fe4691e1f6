"""Optional export to Langfuse (``tracetrain serve --langfuse``).

A trajectory is a Langfuse trace, each captured call a generation in it (model, sampling
parameters, usage, start and end time, the policy version that served it), each reward a
score on it, all on the trajectory's trace id, so later calls and rewards of a trajectory
join the same trace.

Nothing of this runs on the request path: ``call_recorded`` and ``rewards_recorded`` append
to a bounded queue and return (full: the item is dropped and counted). One background task
sends what is queued, ``batch_size`` items at a time or whatever arrived within
``flush_interval_s``; it retries network errors, 429 and 5xx with exponential backoff
(tenacity), gives a request up after ``max_attempts`` (counted), and at shutdown sends what
is left within ``shutdown_timeout_s``. A Langfuse outage therefore costs exports, never a
capture or a millisecond of a call. Delivery is at least once: a request whose answer was
lost is sent again.

Why not the ``langfuse`` SDK (5.0.4 checked). Its client is OpenTelemetry: spans leave
through OpenTelemetry's ``BatchSpanProcessor`` and the OTLP exporter, which posts with
``requests`` (invisible to respx, so tests could not see what is sent); that processor drops
spans from its bounded queue without a count one can read; ``start_observation`` takes no
start time, while the proxy learns of a call once it has finished; and the client keeps
process-wide state (one client per public key, a tracer provider, exit hooks) where the
proxy builds one exporter per app. The older route, the batch endpoint
``/api/public/ingestion`` that SDK v2 used, is retired for traces: Langfuse v4 servers (in
their default write mode) and Langfuse Cloud from 2026-11-16 accept only ``score-create``
there. So this module speaks, over httpx, to the two endpoints the v5 SDK itself uses, in
the format ``proxy.observability._langfuse_wire`` writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from pydantic import SecretStr
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt, wait_exponential

from proxy._settings import Settings
from proxy.observability._langfuse_wire import (
    SCORES_PATH,
    TRACES_PATH,
    encode_spans,
    rejected_scores,
    rejected_spans,
    reward_scores,
)
from store import CallWrite, redact, without_userinfo

log = logging.getLogger("tracetrain.langfuse")

_WARN_EVERY_S = 60.0

_Item = CallWrite | dict[str, Any]  # a recorded call, or a score ready to send


@dataclass(frozen=True, slots=True)
class LangfuseConfig:
    """Where to export and how hard to try. The secret key never prints."""

    public_key: str
    secret_key: SecretStr
    base_url: str = "https://cloud.langfuse.com"
    batch_size: int = 100  # items (generations and scores) sent together
    flush_interval_s: float = 1.0  # the longest an item waits for its batch to fill
    max_queue: int = 10_000  # items held while Langfuse is slow or down; beyond that they are dropped
    max_batch_bytes: int = 2_000_000  # JSON of the spans in one request, before gzip
    max_attempts: int = 5  # tries per request: waits of about 0.25, 0.5, 1, 2 s between them
    backoff_s: float = 0.25
    max_backoff_s: float = 8.0
    timeout_s: float = 10.0
    shutdown_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")


def start_langfuse(settings: Settings) -> LangfuseExporter | None:
    """The exporter, started, when ``settings.langfuse`` is on (call inside the app's lifespan)."""
    if not settings.langfuse:
        return None
    assert settings.langfuse_public_key and settings.langfuse_secret_key  # Settings checks it
    config = LangfuseConfig(settings.langfuse_public_key, settings.langfuse_secret_key, settings.langfuse_base_url)
    exporter = LangfuseExporter(config)
    exporter.start()
    log.info("exporting trajectories to Langfuse at %s", redact(config.base_url))
    return exporter


class LangfuseExporter:
    """Queues recorded calls and rewards and sends them to Langfuse in the background.

    Counters, in items (a generation or a score), for ``/metrics``:

    - ``sent``: accepted by Langfuse;
    - ``dropped``: never sent, because the queue was full or shutdown ran out of time;
    - ``rejected``: refused by Langfuse (a 4xx other than 429, or rejected in a partial success);
    - ``failed``: in requests given up after ``max_attempts``; ``failed_batches`` counts those requests;
    - ``retries``: requests repeated; ``queued``: items waiting now.
    """

    def __init__(self, config: LangfuseConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.sent = 0
        self.dropped = 0
        self.rejected = 0
        self.failed = 0
        self.failed_batches = 0
        self.retries = 0
        self._queue: deque[_Item] = deque()
        self._sending = 0  # items taken from the queue whose fate is not known yet
        self._has_items = asyncio.Event()
        self._batch_full = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._warned_at: dict[str, float] = {}
        self._exponential = wait_exponential(multiplier=config.backoff_s, max=config.max_backoff_s)
        self._client = httpx.AsyncClient(
            base_url=without_userinfo(config.base_url).rstrip("/"),  # the keys authenticate; httpx logs URLs
            auth=httpx.BasicAuth(config.public_key, config.secret_key.get_secret_value()),
            headers={"x-langfuse-ingestion-version": "4"},
            timeout=config.timeout_s,
            transport=transport,
        )

    def __repr__(self) -> str:
        return (
            f"LangfuseExporter(base_url={redact(self.config.base_url)!r}, public_key={self.config.public_key!r}, "
            f"queued={self.queued}, sent={self.sent}, dropped={self.dropped})"
        )

    @property
    def queued(self) -> int:
        return len(self._queue)

    def stats(self) -> dict[str, int]:
        """The counters, at this moment."""
        return {
            "queued": self.queued,
            "sent": self.sent,
            "dropped": self.dropped,
            "rejected": self.rejected,
            "failed": self.failed,
            "failed_batches": self.failed_batches,
            "retries": self.retries,
        }

    # -- the request path: never blocks -------------------------------------------------

    def call_recorded(self, write: CallWrite) -> None:
        """Queue a recorded call as a generation of its trajectory's trace."""
        self._put(write)

    def rewards_recorded(self, rewards: Iterable[Mapping[str, Any]]) -> None:
        """Queue rewards (``store.RewardRecord``'s fields) as scores: ``reward`` and one per metric."""
        for reward in rewards:
            for score in reward_scores(reward):
                self._put(score)

    def _put(self, item: _Item) -> None:
        if self._closing or len(self._queue) >= self.config.max_queue:
            self.dropped += 1
            self._warn("dropped", "Langfuse export queue full: dropping (%d dropped so far)", self.dropped)
            return
        self._queue.append(item)
        self._has_items.set()
        if len(self._queue) >= self.config.batch_size:
            self._batch_full.set()

    # -- the background task -------------------------------------------------------------

    def start(self) -> None:
        """Start sending (inside a running event loop)."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="tracetrain-langfuse")

    async def aclose(self) -> None:
        """Send what is queued within ``shutdown_timeout_s`` (the rest counts as dropped), then stop."""
        self._closing = True
        self._has_items.set()
        self._batch_full.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, self.config.shutdown_timeout_s)
            except TimeoutError:
                lost = len(self._queue) + self._sending
                self.dropped += lost
                self._queue.clear()
                log.warning("Langfuse export: %d items not sent at shutdown (time limit reached)", lost)
        await self._client.aclose()

    async def _run(self) -> None:
        while True:
            await self._has_items.wait()
            if not self._closing and len(self._queue) < self.config.batch_size:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._batch_full.wait(), self.config.flush_interval_s)
            batch = self._take()
            try:
                await self._send(batch)
            except Exception:  # a bug in one batch must not end every later export
                log.exception("Langfuse export: a batch of %d items could not be sent", len(batch))
                self.failed += self._sending
                self.failed_batches += 1
                self._sending = 0
            if self._closing and not self._queue:
                return

    def _take(self) -> list[_Item]:
        batch = [self._queue.popleft() for _ in range(min(len(self._queue), self.config.batch_size))]
        if len(self._queue) < self.config.batch_size:
            self._batch_full.clear()
        if not self._queue and not self._closing:
            self._has_items.clear()
        self._sending = len(batch)
        return batch

    async def _send(self, batch: list[_Item]) -> None:
        calls = [item for item in batch if isinstance(item, CallWrite)]
        scores = [item for item in batch if not isinstance(item, CallWrite)]
        if calls:
            # Serializing prompts and replies is the costly part: keep it off the event loop.
            bodies = await asyncio.to_thread(encode_spans, calls, self.config.max_batch_bytes)
            for body, count in bodies:
                await self._post(TRACES_PATH, body, count, "generations", rejected_spans, gzipped=True)
                self._sending -= count
        if scores:
            await self._post(SCORES_PATH, orjson.dumps(scores), len(scores), "scores", rejected_scores)
        self._sending = 0

    async def _post(
        self,
        path: str,
        body: bytes,
        count: int,
        what: str,
        rejected_in: Callable[[httpx.Response], int],
        *,
        gzipped: bool = False,
    ) -> None:
        headers = {"Content-Type": "application/json"} | ({"Content-Encoding": "gzip"} if gzipped else {})
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.config.max_attempts),
            wait=self._wait,
            retry=retry_if_exception_type(_Transient),
            before_sleep=self._count_retry,
            reraise=True,  # the last _Transient, not tenacity's RetryError
        )
        try:
            response: httpx.Response = await retrying(self._post_once, path, body, headers)
        except _Transient as exc:
            self.failed += count
            self.failed_batches += 1
            tries = self.config.max_attempts
            self._warn("failed", "Langfuse export: gave up on %d %s after %d tries (%s)", count, what, tries, exc)
            return
        status = response.status_code
        if status < 300:
            rejected = min(count, rejected_in(response))
            self.sent += count - rejected
            if rejected:
                self.rejected += rejected
                self._warn("partial", "Langfuse rejected %d of %d %s: %s", rejected, count, what, response.text)
            return
        self.rejected += count
        self._warn("refused", "Langfuse refused %d %s (HTTP %d): %s", count, what, status, response.text)

    async def _post_once(self, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
        """One request: its response, or ``_Transient`` when the next may get through."""
        try:
            response = await self._client.post(path, content=body, headers=headers)
        except httpx.TransportError as exc:
            raise _Transient(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code == 429 or response.status_code >= 500:
            raise _Transient(f"HTTP {response.status_code}")
        return response

    def _wait(self, state: RetryCallState) -> float:
        """backoff_s, then twice that after each failed request, capped; times 0.5 to 1 (jitter)."""
        return float(self._exponential(state)) * random.uniform(0.5, 1.0)

    def _count_retry(self, state: RetryCallState) -> None:
        self.retries += 1

    def _warn(self, kind: str, message: str, *args: object) -> None:
        """Log a warning of this kind at most once a minute: an outage must not flood the log."""
        now = time.monotonic()
        if now - self._warned_at.get(kind, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            self._warned_at[kind] = now
            log.warning(message, *(a[:500] if isinstance(a, str) else a for a in args))


class _Transient(Exception):
    """A request that may get through if sent again: no connection, 429 or 5xx; the message says which."""
