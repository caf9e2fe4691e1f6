"""Training jobs, seen from the proxy: when enough groups are ready, one job takes them.

A group is *ready* when it is ``open``, every trajectory in it is rewarded and it has at
least ``min_group_size`` of them. When ``batch_groups`` ready groups of a policy exist
(or an admin asks), one transaction creates a queued job and moves its groups to
``training``: a group is used once. The trainer worker claims queued jobs from the
store; the proxy never imports it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sqlalchemy import and_, func, insert, select, update

from proxy.gateway._keying import Keyer
from store._store import G, J, Store, T


class JobScheduler:
    """Creates training jobs from ready groups; one instance per proxy process."""

    def __init__(self, store: Store, keyer: Keyer, *, policy: str, batch_groups: int, min_group_size: int) -> None:
        self._store = store
        self._keyer = keyer
        self._policy = policy
        self._batch_groups = batch_groups
        self._min_group_size = min_group_size
        self._lock = asyncio.Lock()

    async def ready_groups(self) -> list[str]:
        size = func.count(T.c.pk)
        query = (
            select(G.c.id)
            .select_from(G.join(T, T.c.group_id == G.c.id))
            .where(G.c.policy == self._policy, G.c.state == "open")
            .group_by(G.c.id, G.c.created_at)
            .having(and_(size >= self._min_group_size, func.count(T.c.reward) == size))
            .order_by(G.c.created_at)
        )
        async with self._store.engine.connect() as conn:
            return [row[0] for row in (await conn.execute(query)).all()]

    async def maybe_create_job(self, *, force: bool = False) -> dict[str, Any] | None:
        """Create a job if ``batch_groups`` groups are ready (any ready group if ``force``).

        Returns the job's row, or None when there is not enough to train on.
        """
        async with self._lock:
            ready = await self.ready_groups()
            if not ready or (len(ready) < self._batch_groups and not force):
                return None
            groups = ready if force else ready[: self._batch_groups]
            now = time.time()
            try:
                job_id = await self._create(groups, now)
            except _TakenMeanwhile:
                return None
            self._keyer.forget_groups(groups)  # new attempts at these tasks open new groups
            return {"id": job_id, "policy": self._policy, "state": "queued", "group_ids": groups, "created_at": now}

    async def _create(self, groups: list[str], now: float) -> int:
        async with self._store.engine.begin() as conn:
            job = insert(J).values(
                policy=self._policy, state="queued", group_ids=groups, metrics={}, progress=0.0, created_at=now
            )
            job_id = int((await conn.execute(job.returning(J.c.id))).scalar_one())
            taken = await conn.execute(
                update(G).where(G.c.id.in_(groups), G.c.state == "open").values(state="training", job_id=job_id)
            )
            if taken.rowcount != len(groups):  # another replica took some of them first: roll back
                raise _TakenMeanwhile
        return job_id


class _TakenMeanwhile(Exception):
    pass
