"""Disk usage in view: bytes per part, free space, and a warning when it runs low; retention of data.

Every ``interval_s`` (60 s) in the background: the store's parts (``Store.disk_bytes``: calls,
stored adapter files, the whole database), the data directory's ``adapters/`` and ``logs/``, and
the free space of its filesystem. The numbers go to ``/metrics`` (``tracetrain_disk_*``), the
dashboard's overview and ``/readyz``'s body; under ``--min-free-disk`` a warning is logged
(when it starts, then every ``interval_s`` * 10 while it lasts) and ``/readyz`` names it while
staying ready (a full disk stops capture, not serving).

With ``--keep-trajectories DAYS`` the same beat deletes the trajectories older than that
(``Store.prune_trajectories``; ``store._retention`` says what is never deleted).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy._periodic import every
from proxy.observability._metrics import Metrics
from store import PruneRule, Store

log = logging.getLogger("tracetrain.disk")

_DAY_S = 86_400.0


@dataclass(frozen=True, slots=True)
class DiskUsage:
    parts: dict[str, int]  # part -> bytes
    free: int  # bytes free on the data directory's filesystem
    low: bool  # free < the threshold
    threshold: int
    measured_at: float = field(default_factory=time.time)

    def warning(self) -> str | None:
        if not self.low:
            return None
        return (f"free disk space is {_size(self.free)}, under --min-free-disk {_size(self.threshold)}: "
                "capture stops when the disk is full (serving goes on); see docs/OPERATIONS.md")  # fmt: skip

    def view(self) -> dict[str, Any]:
        return {"parts": self.parts, "free_bytes": self.free, "low": self.low, "warning": self.warning(),
                "measured_at": self.measured_at}  # fmt: skip


class DiskWatch:
    def __init__(
        self, store: Store, metrics: Metrics, data_dir: Path, *, min_free_bytes: int,
        keep_trajectories_days: float | None = None, interval_s: float = 60.0,
    ) -> None:  # fmt: skip
        self._store = store
        self._metrics = metrics
        self._data_dir = data_dir
        self._min_free = min_free_bytes
        self._keep_days = keep_trajectories_days
        self._interval_s = interval_s
        self.latest: DiskUsage | None = None
        self._warned_at = 0.0

    async def run(self) -> None:
        """Measure (and prune, with --keep-trajectories) every ``interval_s`` until cancelled; errors are logged."""
        await every(self._interval_s, self.check_once, log, "measuring disk usage failed; trying again")

    async def check_once(self) -> DiskUsage:
        if self._keep_days is not None:
            await self._prune()
        parts = await self._store.disk_bytes()
        parts |= await asyncio.to_thread(self._dir_bytes)
        free = await asyncio.to_thread(lambda: shutil.disk_usage(self._data_dir).free)
        usage = DiskUsage(parts, free, free < self._min_free, self._min_free)
        self.latest = usage
        for part, size in parts.items():
            self._metrics.disk_bytes.labels(part).set(size)
        self._metrics.disk_free.set(free)
        self._metrics.disk_low.set(int(usage.low))
        self._warn(usage)
        return usage

    def _warn(self, usage: DiskUsage) -> None:
        now = time.monotonic()
        if not usage.low:
            if self._warned_at:
                log.info("free disk space is back to %s", _size(usage.free))
            self._warned_at = 0.0
        elif not self._warned_at or now - self._warned_at >= 10 * self._interval_s:
            log.warning("%s", usage.warning())
            self._warned_at = now

    async def _prune(self) -> None:
        assert self._keep_days is not None
        rule = PruneRule(before=time.time() - self._keep_days * _DAY_S)
        report = await self._store.prune_trajectories(rule)
        if report.trajectories:
            log.info("retention: deleted %d trajectories older than %g days (%d calls, %d rewards, %d groups)",
                     report.trajectories, self._keep_days, report.calls, report.rewards, report.groups)  # fmt: skip

    def _dir_bytes(self) -> dict[str, int]:
        return {name: _tree_bytes(self._data_dir / name) for name in ("adapters", "logs")}


def _tree_bytes(root: Path) -> int:
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:  # deleted meanwhile (retention)
                continue
    return total


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
