"""What ``tracetrain export`` reads: the selected trajectories with their calls, in pages.

Pages are keyset reads on the trajectory key up to the newest key when the export
started, so memory stays flat however large the store is and rows captured meanwhile
are left for the next export.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from store._compact import expand
from store._tables import calls as C
from store._tables import trajectories as T


@dataclass(frozen=True, slots=True)
class ExportFilter:
    """Which trajectories to export; None means no condition."""

    min_reward: float | None = None  # only rewarded trajectories with reward >= this
    policy: str | None = None

    def conditions(self) -> list[ColumnElement[bool]]:
        where: list[ColumnElement[bool]] = []
        if self.min_reward is not None:
            where.append(T.c.reward >= self.min_reward)  # NULL (unrewarded) never passes
        if self.policy is not None:
            where.append(T.c.policy == self.policy)
        return where

    def describe(self) -> str:
        parts = [f"reward >= {self.min_reward:g}"] if self.min_reward is not None else []
        parts += [f"policy {self.policy}"] if self.policy is not None else []
        return ", ".join(parts) or "no filter"


@dataclass(frozen=True, slots=True)
class RewardSummary:
    """What a store holds, for a refusal that says what to change."""

    trajectories: int
    rewarded: int
    best: float | None


@dataclass(frozen=True, slots=True)
class ExportPage:
    trajectories: list[dict[str, Any]]  # oldest first
    calls: dict[str, list[dict[str, Any]]]  # trajectory id -> its calls in order


class ExportReads:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def count(self, where: ExportFilter) -> int:
        async with self._engine.connect() as conn:
            query = select(func.count()).select_from(T).where(*where.conditions())
            return int((await conn.execute(query)).scalar_one())

    async def reward_summary(self, policy: str | None) -> RewardSummary:
        query = select(func.count(T.c.pk), func.count(T.c.reward), func.max(T.c.reward))
        if policy is not None:
            query = query.where(T.c.policy == policy)
        async with self._engine.connect() as conn:
            total, rewarded, best = (await conn.execute(query)).one()
        return RewardSummary(int(total), int(rewarded), None if best is None else float(best))

    async def newest_key(self) -> int:
        """The newest trajectory's key: an export covers the trajectories up to it."""
        async with self._engine.connect() as conn:
            return int((await conn.execute(select(func.max(T.c.pk)))).scalar() or 0)

    async def metric_names(self, where: ExportFilter, newest: int) -> list[str]:
        """Every metric name of the selected trajectories, sorted: the ``metrics`` keys of every row."""
        names: set[str] = set()
        async with self._engine.connect() as conn:
            rows = await conn.stream(select(T.c.metrics).where(*where.conditions(), T.c.pk <= newest))
            async for (metrics,) in rows:
                names.update(metrics or ())
        return sorted(names)

    async def pages(self, where: ExportFilter, newest: int, page_size: int) -> AsyncIterator[ExportPage]:
        """The selected trajectories up to ``newest``, oldest first, ``page_size`` at a time."""
        after = 0
        while True:
            async with self._engine.connect() as conn:
                trajectories = (
                    await conn.execute(
                        select(T)
                        .where(*where.conditions(), T.c.pk > after, T.c.pk <= newest)
                        .order_by(T.c.pk)
                        .limit(page_size)
                    )
                ).all()
                if not trajectories:
                    return
                ids = [t.id for t in trajectories]
                calls = (
                    await conn.execute(
                        select(C).where(C.c.trajectory_id.in_(ids)).order_by(C.c.trajectory_id, C.c.started_at, C.c.pk)
                    )
                ).all()
            calls_of: dict[str, list[dict[str, Any]]] = {trajectory_id: [] for trajectory_id in ids}
            for call in calls:
                calls_of[call.trajectory_id].append(dict(call._mapping))
            for rows in calls_of.values():
                expand(rows)
            yield ExportPage([dict(t._mapping) for t in trajectories], calls_of)
            after = trajectories[-1].pk
