"""The one shape of every background task in the proxy: every N seconds, run, log a failure, go on.

The publisher, the upstream health check, the regression guard, the step watch, the GPU
hand-over, the judge's scan, ``--reward-timeout`` and the disk watch each run ``every(...)``
as an ``asyncio`` task that ``proxy._services`` starts and cancels when the app stops. A
failure (the store briefly unavailable, a vLLM that went away) is logged with its traceback
and the next beat tries again: serving never stops because a background task failed.
Cancellation is the one way out, and it is never swallowed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import NoReturn


async def every(interval_s: float, beat: Callable[[], Awaitable[object]], log: logging.Logger, failed: str) -> NoReturn:
    """Await ``beat()`` every ``interval_s`` until cancelled; a failure is logged as ``failed``, then the next."""
    while True:
        try:
            await beat()
        except Exception:
            log.exception("%s", failed)
        await asyncio.sleep(interval_s)
