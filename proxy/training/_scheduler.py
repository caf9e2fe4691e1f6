"""Training jobs, seen from the proxy: when enough groups of a policy are ready, one job takes them.

A group is *ready* when it is ``open``, every trajectory in it is rewarded and it has at
least its policy's ``min_group_size`` of them. When its policy's ``batch_groups`` ready groups
exist (or an admin asks), the store creates a queued job and moves its groups to ``training``
in one transaction: a group is used once, and a job holds one policy's groups. While the regression
guard has paused a policy's training (``proxy.training._guard``), no job of it is created. The
trainer worker claims queued jobs from the store, the policies in turn (``store.Jobs.claim_next``);
the proxy never imports it.

Every reward written, posted (``POST /v1/rewards``) or judged, passes ``rewards_written``: counted
in ``/metrics``, queued for the trace exporters (OTLP, Langfuse), and a job made for each policy it made due.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from proxy.gateway import PolicyRegistry
from proxy.observability._exporters import Exporters
from proxy.observability._metrics import Metrics
from store import JobState, RewardRecord, Store, StoreFull, StoreUnavailable, TrainingState

log = logging.getLogger("tracetrain.scheduler")


class JobScheduler:
    """Creates training jobs from ready groups, per policy; one instance per proxy process."""

    def __init__(
        self,
        store: Store,
        registry: PolicyRegistry,
        *,
        metrics: Metrics | None = None,
        exporters: Exporters | None = None,
    ) -> None:
        self._store = store
        self._registry = registry
        self._metrics = metrics
        self._exporters = exporters
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def ready_groups(self, policy: str) -> list[str]:
        """The ready groups of a served policy, oldest first (none for a policy not served)."""
        if policy not in self._registry:
            return []
        size = self._registry.get(policy).settings.min_group_size
        return await self._store.jobs.ready_groups(policy, size)

    async def paused(self, policy: str) -> str | None:
        """Why ``policy``'s training is paused (the regression guard rolled a version back), or None while it
        trains."""
        training = await self._store.guards.training(policy)
        if training["training"] == TrainingState.PAUSED:
            return str(training["training_reason"] or "paused")
        return None

    async def maybe_create_job(self, policy: str, *, force: bool = False) -> dict[str, Any] | None:
        """Create a job of ``policy`` if its ``batch_groups`` groups are ready (any ready group if ``force``).

        Returns the job's row, or None when there is not enough to train on, training is paused, or the
        policy is not served.
        """
        async with self._locks[policy]:
            if policy not in self._registry or await self.paused(policy):
                return None
            ready = await self.ready_groups(policy)
            batch = self._registry.get(policy).settings.batch_groups
            if not ready or (len(ready) < batch and not force):
                return None
            groups = ready if force else ready[:batch]
            job_id = await self._store.jobs.create(policy, groups)
            if job_id is None:  # another replica took some of them first
                return None
            return {"id": job_id, "policy": policy, "state": JobState.QUEUED.value, "group_ids": groups,
                    "created_at": time.time()}  # fmt: skip

    async def rewards_written(self, rewards: Sequence[RewardRecord], *, may_train: bool = True) -> None:
        """Rewards just written (posted or judged): counted, exported, and, when they may make groups
        ready (``may_train``; not the judge's scores beside external rewards), a job for each policy due."""
        if not rewards:
            return
        policy_of = await self._store.jobs.group_policies(sorted({r.group_id for r in rewards}))
        if self._metrics is not None:
            self._metrics.rewards_recorded([(policy_of.get(r.group_id, ""), r.source) for r in rewards])
        if self._exporters is not None:
            self._exporters.rewards_recorded([dataclasses.asdict(r) for r in rewards])
        if may_train:
            for policy in sorted(set(policy_of.values())):
                await self._job_if_due(policy)

    async def _job_if_due(self, policy: str) -> None:
        """``maybe_create_job`` after rewards were written: a job the store cannot take now (its disk full, the
        database gone) is not the rewards' failure, as they are recorded. Their groups stay ready, and the next
        reward of the policy (or an admin's train-now) makes the job."""
        try:
            await self.maybe_create_job(policy)
        except StoreFull:
            pass  # the log tells a full disk once (store._full_disk)
        except StoreUnavailable as exc:
            log.warning("no training job of %s made now (%s); the next reward tries again", policy, exc)
