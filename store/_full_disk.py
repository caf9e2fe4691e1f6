"""A full disk in the log: one warning when writes start failing for want of space, one line when they succeed again.

On a full disk every call's record fails (the group-commit writer), and so may every reward, seat and
job written meanwhile: a line (or a traceback) for each would bury the log in thousands of them within
seconds, and a log on the same disk could not take them anyway. So a full disk is an *episode*: the
first failure warns, with what goes on meanwhile; the writes that fail after it are only counted; the
first write that succeeds again ends it, saying how many failed. A failure long after the last one
(``QUIET_S``) with no success seen between (nothing wrote meanwhile) starts a new episode.

The writer's thread and the event loop both report here, so the state sits under a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from store._redact import redact

log = logging.getLogger("tracetrain.store")

QUIET_S = 60.0  # a failure this long after the last one warns again


class FullDiskEpisodes:
    """The episodes of a full disk as the log tells them (the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._failed = 0  # writes failed in the current episode; 0: none under way
        self._began = 0.0
        self._last = 0.0

    @property
    def under_way(self) -> bool:
        return self._failed > 0

    def failed(self, doing: str, error: BaseException | str) -> None:
        """A write (``doing``: what it was) failed for want of space."""
        now = self._clock()
        with self._lock:
            new = self._failed == 0 or now - self._last > QUIET_S
            if new:
                self._failed, self._began = 0, now
            self._failed += 1
            self._last = now
        if new:
            log.warning(
                "the store's disk is full (%s: %s): calls are answered and not recorded (counted in "
                "tracetrain_capture_failures_total{reason=\"disk_full\"}), other writes answer 503, until space "
                "is freed; see docs/OPERATIONS.md", doing, redact(str(error)).splitlines()[0] if str(error) else "",
            )  # fmt: skip

    def succeeded(self) -> None:
        """A write succeeded: an episode under way ends."""
        if self._failed == 0:  # the common case, without the lock: a stale read only delays the line by a write
            return
        now = self._clock()
        with self._lock:
            failed, self._failed = self._failed, 0
            lasted = now - self._began
        if failed:
            log.warning("the store's disk takes writes again: %d failed for want of space over %.0f s", failed, lasted)


# The process's one account of the disk: the writer, the store's other writes and the app's handlers share it.
FULL_DISK = FullDiskEpisodes()
