"""Langfuse (``tracetrain serve --langfuse``): one more receiver of the OTLP export, and scores for rewards.

A trajectory is a Langfuse trace, each captured call a generation in it (model, sampling
parameters, usage, start and end time, the policy version that served it), each reward a
score on it, all on the trajectory's trace id, so later calls and rewards of a trajectory
join the same trace.

The generations travel as every collector's spans do (``proxy.observability._otlp``: OpenTelemetry's
batch processor and OTLP/HTTP exporter), to Langfuse's OTLP endpoint with its basic auth and
``x-langfuse-ingestion-version: 4``, each span in Langfuse's dialect (``_langfuse_wire``). Only
these headers reach Langfuse: the ``OTEL_EXPORTER_OTLP_*HEADERS`` meant for a collector do not.

Rewards are not spans in Langfuse but scores, which OTLP cannot carry: ``LangfuseScores`` posts them
to ``/api/public/scores``. Nothing of this runs on the request path: ``rewards_recorded`` appends to
a bounded queue and returns (full: the score is dropped and counted). One background task sends
what is queued, ``batch_size`` scores at a time or whatever arrived within ``flush_interval_s``; it
retries network errors, 429 and 5xx with exponential backoff (tenacity), gives a request up after
``max_attempts`` (counted), and at shutdown sends what is left within ``shutdown_timeout_s``.

Why not the ``langfuse`` SDK (5.0.4 checked): it is the same OpenTelemetry pipeline, but behind a
process-wide client (one per public key, a global tracer provider, exit hooks) where the proxy builds
one exporter per app, and ``start_observation`` takes no start time, while the proxy learns of a call
once it has finished.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from pydantic import SecretStr
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt, wait_exponential

from proxy.observability._langfuse_wire import SCORES_PATH, rejected_scores, reward_scores
from store import redact, without_userinfo

log = logging.getLogger("tracetrain.langfuse")

_WARN_EVERY_S = 60.0


@dataclass(frozen=True, slots=True)
class LangfuseConfig:
    """Where to export and how hard to try with scores (spans: ``ExportConfig``). The secret key never prints."""

    public_key: str
    secret_key: SecretStr
    base_url: str = "https://cloud.langfuse.com"
    batch_size: int = 100  # scores sent together
    flush_interval_s: float = 1.0  # the longest a score waits for its batch to fill
    max_queue: int = 10_000  # scores held while Langfuse is slow or down; beyond that they are dropped
    max_attempts: int = 5  # tries per request: waits of about 0.25, 0.5, 1, 2 s between them
    backoff_s: float = 0.25
    max_backoff_s: float = 8.0
    timeout_s: float = 10.0
    shutdown_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")

    def basic_auth(self) -> str:
        token = base64.b64encode(f"{self.public_key}:{self.secret_key.get_secret_value()}".encode()).decode()
        return f"Basic {token}"


class LangfuseScores:
    """Queues rewards as Langfuse scores and posts them in the background.

    Counters, in scores, for ``/metrics``: ``sent``; ``dropped`` (queue full, or shutdown out of
    time); ``rejected`` (a 4xx other than 429, or rejected in a 207); ``failed`` (in requests given
    up after ``max_attempts``); ``queued`` (waiting now).
    """

    def __init__(self, config: LangfuseConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.sent = self.dropped = self.rejected = self.failed = 0
        self._queue: deque[dict[str, Any]] = deque()
        self._sending = 0  # scores taken from the queue whose fate is not known yet
        self._has_items = asyncio.Event()
        self._batch_full = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._warned_at: dict[str, float] = {}
        self._exponential = wait_exponential(multiplier=config.backoff_s, max=config.max_backoff_s)
        self._client = httpx.AsyncClient(
            base_url=without_userinfo(config.base_url).rstrip("/"),  # the keys authenticate; httpx logs URLs
            auth=httpx.BasicAuth(config.public_key, config.secret_key.get_secret_value()),
            timeout=config.timeout_s,
            transport=transport,
        )

    def __repr__(self) -> str:
        return f"LangfuseScores(base_url={redact(self.config.base_url)!r}, queued={self.queued}, sent={self.sent})"

    @property
    def queued(self) -> int:
        return len(self._queue)

    def stats(self) -> dict[str, int]:
        return {"queued": self.queued, "sent": self.sent, "dropped": self.dropped, "rejected": self.rejected,
                "failed": self.failed}  # fmt: skip

    def rewards_recorded(self, rewards: Iterable[Mapping[str, Any]]) -> None:
        """Queue rewards (as ``POST /v1/rewards`` answers them) as scores: ``reward`` and one per metric."""
        for reward in rewards:
            for score in reward_scores(reward):
                if self._closing or len(self._queue) >= self.config.max_queue:
                    self.dropped += 1
                    self._warn("dropped", "Langfuse score queue full: dropping (%d dropped so far)", self.dropped)
                    continue
                self._queue.append(score)
                self._has_items.set()
                if len(self._queue) >= self.config.batch_size:
                    self._batch_full.set()

    def start(self) -> None:
        """Start sending (inside a running event loop)."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="tracetrain-langfuse-scores")

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
                log.warning("Langfuse export: %d scores not sent at shutdown (time limit reached)", lost)
        await self._client.aclose()

    async def _run(self) -> None:
        while True:
            await self._has_items.wait()
            if not self._closing and len(self._queue) < self.config.batch_size:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._batch_full.wait(), self.config.flush_interval_s)
            batch = [self._queue.popleft() for _ in range(min(len(self._queue), self.config.batch_size))]
            if len(self._queue) < self.config.batch_size:
                self._batch_full.clear()
            if not self._queue and not self._closing:
                self._has_items.clear()
            self._sending = len(batch)
            try:
                await self._post(batch)
            except Exception:  # a bug in one batch must not end every later export
                log.exception("Langfuse export: a batch of %d scores could not be sent", len(batch))
                self.failed += len(batch)
            self._sending = 0
            if self._closing and not self._queue:
                return

    async def _post(self, scores: list[dict[str, Any]]) -> None:
        if not scores:
            return
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.config.max_attempts),
            wait=self._wait,
            retry=retry_if_exception_type(_Transient),
            reraise=True,  # the last _Transient, not tenacity's RetryError
        )
        try:
            response: httpx.Response = await retrying(self._post_once, orjson.dumps(scores))
        except _Transient as exc:
            self.failed += len(scores)
            tries = self.config.max_attempts
            self._warn("failed", "Langfuse export: gave up on %d scores after %d tries (%s)", len(scores), tries, exc)
            return
        if response.status_code < 300:
            rejected = min(len(scores), rejected_scores(response))
            self.sent += len(scores) - rejected
            if rejected:
                self.rejected += rejected
                self._warn("partial", "Langfuse rejected %d of %d scores: %s", rejected, len(scores), response.text)
            return
        self.rejected += len(scores)
        self._warn("refused", "Langfuse refused %d scores (HTTP %d): %s", len(scores), response.status_code,
                   response.text)  # fmt: skip

    async def _post_once(self, body: bytes) -> httpx.Response:
        """One request: its response, or ``_Transient`` when the next may get through."""
        try:
            response = await self._client.post(SCORES_PATH, content=body, headers={"Content-Type": "application/json"})
        except httpx.TransportError as exc:
            raise _Transient(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code == 429 or response.status_code >= 500:
            raise _Transient(f"HTTP {response.status_code}")
        return response

    def _wait(self, state: RetryCallState) -> float:
        """backoff_s, then twice that after each failed request, capped; times 0.5 to 1 (jitter)."""
        return float(self._exponential(state)) * random.uniform(0.5, 1.0)

    def _warn(self, kind: str, message: str, *args: object) -> None:
        """Log a warning of this kind at most once a minute: an outage must not flood the log."""
        now = time.monotonic()
        if now - self._warned_at.get(kind, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            self._warned_at[kind] = now
            log.warning(message, *(a[:500] if isinstance(a, str) else a for a in args))


class _Transient(Exception):
    """A request that may get through if sent again: no connection, 429 or 5xx; the message says which."""
