"""The gate in front of vLLM: open, except while a training step has the GPU (``--share-gpu``).

Every generation call passes it once, after its body is validated and before it is routed:
``await gate.enter()``, then ``gate.leave()`` once the upstream has answered (a stream: its
headers). Open, passing is a flag test and a counter: nothing awaits, nothing is made.

``close()`` holds new calls and returns once every call that passed before has its answer,
so nothing reaches vLLM after it was told to pause. ``open()`` lets the held calls go; they
are routed only then, so the policy's newest version (loaded during the hand-over) serves
them. A call held longer than ``wait_s`` is answered ``GpuBusy`` (503 with Retry-After).
``fail(reason)`` (vLLM did not wake up) answers held and new calls ``GpuBusy`` at once,
until ``open()``; ``hold()`` turns a failed gate back into one that holds.

The coordinator of the hand-over (``proxy.training._handover``) is the only one that closes
and opens it; without ``--share-gpu`` nothing does, and the gate stays open.
"""

from __future__ import annotations

import asyncio
import contextlib

from proxy.errors import GpuBusy
from proxy.observability._metrics import Metrics

# What a held call that timed out is told: try again in this many seconds.
RETRY_AFTER_S = 10
# A vLLM that did not wake is being restarted: a CPU takes ~30-100 s, a GPU about as much.
RETRY_AFTER_FAILED_S = 30
NOT_AWAKE = "vllm_not_awake"  # the error code of calls answered while vLLM does not wake


class Gate:
    def __init__(self, wait_s: float, metrics: Metrics | None = None) -> None:
        self.wait_s = wait_s
        self.held = 0  # calls waiting now
        self._metrics = metrics
        self._open = True
        self._failed: str | None = None
        self._sending = 0  # calls that passed and have no answer yet
        self._changed = asyncio.Event()  # set (and replaced) on every open or fail: wakes the held calls
        self._drained: asyncio.Event | None = None

    @property
    def is_open(self) -> bool:
        return self._open

    async def enter(self) -> None:
        """Pass, at once when open; else wait for ``open()`` (``GpuBusy`` after ``wait_s``, or on ``fail``)."""
        if not self._open:
            await self._hold()
        self._sending += 1

    def leave(self) -> None:
        """The upstream answered the call that entered (or it ended before it was sent)."""
        self._sending -= 1
        if self._sending == 0 and self._drained is not None:
            self._drained.set()

    async def close(self) -> None:
        """Hold new calls; return once every call already passed has its answer."""
        self._open = False
        if self._sending:
            self._drained = drained = asyncio.Event()
            try:
                await drained.wait()
            finally:
                self._drained = None

    def open(self) -> None:
        self._open, self._failed = True, None
        self._notify()

    def hold(self) -> None:
        """Hold new calls (no longer answer them ``GpuBusy`` after a ``fail``) until ``open()``."""
        self._open, self._failed = False, None
        self._notify()

    def fail(self, reason: str) -> None:
        """Answer held and new calls at once with ``reason`` (a 503) until ``open()``."""
        self._open, self._failed = False, reason
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _hold(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        self.held += 1
        if self._metrics is not None:
            self._metrics.requests_held.inc()
        try:
            while not self._open:
                if self._failed is not None:
                    raise GpuBusy(self._failed, retry_after_s=RETRY_AFTER_FAILED_S, code=NOT_AWAKE)
                left = deadline - loop.time()
                if left <= 0:
                    if self._metrics is not None:
                        self._metrics.requests_held_timeout.inc()
                    raise GpuBusy(
                        f"The model is paused while a training step has the GPU; this request waited "
                        f"{self.wait_s:g} s (--handover-wait) for it to end. Try again shortly.",
                        retry_after_s=RETRY_AFTER_S,
                    )
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), left)
        finally:
            self.held -= 1
