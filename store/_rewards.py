"""Posted rewards: recorded in one transaction, or not at all."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from store._errors import UnknownTrajectories
from store._tables import rewards as R
from store._tables import trajectories as T


@dataclass(frozen=True, slots=True)
class RewardIn:
    trajectory_id: str
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)
    source: str = "external"
    explanation: str | None = None


async def add_rewards(engine: AsyncEngine, rewards: Iterable[RewardIn]) -> list[dict[str, Any]]:
    """Record rewards in one transaction; any unknown trajectory id rejects the whole batch.

    An external reward becomes the trajectory's reward (and ends its threading: a rewarded
    trajectory takes no more calls by continuation). Returns the rows written.
    """
    items = list(rewards)
    wanted = {r.trajectory_id for r in items}
    now = time.time()
    async with engine.begin() as conn:
        rows = (await conn.execute(select(T.c.id, T.c.group_id).where(T.c.id.in_(wanted)))).all()
        group_of = {row[0]: row[1] for row in rows}
        if missing := wanted - group_of.keys():
            raise UnknownTrajectories(list(missing))
        created = [
            {"trajectory_id": r.trajectory_id, "group_id": group_of[r.trajectory_id], "value": r.reward,
             "metrics": r.metrics, "source": r.source, "explanation": r.explanation, "created_at": now}
            for r in items
        ]  # fmt: skip
        await conn.execute(insert(R), created)
        if external := [r for r in items if r.source == "external"]:
            await conn.execute(
                update(T)
                .where(T.c.id == bindparam("b_id"))
                .values(reward=bindparam("b_r"), reward_source="external", metrics=bindparam("b_m"),
                        rewarded_at=now, tail_hash=None)
                ,
                # In key order, as every writer of trajectories does (no deadlock between replicas);
                # the sort is stable, so the later of two rewards for one trajectory still wins.
                [{"b_id": r.trajectory_id, "b_r": r.reward, "b_m": r.metrics}
                 for r in sorted(external, key=lambda r: r.trajectory_id)],
            )  # fmt: skip
    return created
