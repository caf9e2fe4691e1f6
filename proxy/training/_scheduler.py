"""Training jobs, seen from the proxy: when enough groups are ready, one job takes them.

A group is *ready* when it is ``open``, every trajectory in it is rewarded and it has at
least ``min_group_size`` of them. When ``batch_groups`` ready groups of a policy exist
(or an admin asks), the store creates a queued job and moves its groups to ``training``
in one transaction: a group is used once. While the regression guard has paused the
policy's training (``proxy.training._guard``), no job is created. The trainer worker claims queued jobs from the
store; the proxy never imports it.

Every reward written, posted (``POST /v1/rewards``) or judged, passes ``rewards_written``: counted
in ``/metrics``, queued for the trace exporters (OTLP, Langfuse), and a job made if enough groups are ready.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from proxy.observability._exporters import Exporters
from proxy.observability._metrics import Metrics
from store import JobState, RewardRecord, Store, TrainingState


class JobScheduler:
    """Creates training jobs from ready groups; one instance per proxy process."""

    def __init__(
        self,
        store: Store,
        *,
        policy: str,
        batch_groups: int,
        min_group_size: int,
        metrics: Metrics | None = None,
        exporters: Exporters | None = None,
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._exporters = exporters
        self._policy = policy
        self._batch_groups = batch_groups
        self._min_group_size = min_group_size
        self._lock = asyncio.Lock()

    async def ready_groups(self) -> list[str]:
        return await self._store.jobs.ready_groups(self._policy, self._min_group_size)

    async def paused(self) -> str | None:
        """Why training is paused (the regression guard rolled a version back), or None while it trains."""
        training = await self._store.guards.training(self._policy)
        if training["training"] == TrainingState.PAUSED:
            return str(training["training_reason"] or "paused")
        return None

    async def maybe_create_job(self, *, force: bool = False) -> dict[str, Any] | None:
        """Create a job if ``batch_groups`` groups are ready (any ready group if ``force``).

        Returns the job's row, or None when there is not enough to train on, or training is paused.
        """
        async with self._lock:
            if await self.paused():
                return None
            ready = await self.ready_groups()
            if not ready or (len(ready) < self._batch_groups and not force):
                return None
            groups = ready if force else ready[: self._batch_groups]
            job_id = await self._store.jobs.create(self._policy, groups)
            if job_id is None:  # another replica took some of them first
                return None
            return {"id": job_id, "policy": self._policy, "state": JobState.QUEUED.value, "group_ids": groups,
                    "created_at": time.time()}  # fmt: skip

    async def rewards_written(self, rewards: Sequence[RewardRecord], *, may_train: bool = True) -> None:
        """Rewards just written (posted or judged): counted, exported, and, when they may make groups
        ready (``may_train``; not the judge's scores beside external rewards), a job if due."""
        if self._metrics is not None:
            self._metrics.rewards_recorded([r.source for r in rewards])
        if self._exporters is not None:
            self._exporters.rewards_recorded([dataclasses.asdict(r) for r in rewards])
        if may_train:
            await self.maybe_create_job()
