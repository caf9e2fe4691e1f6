"""``--reward-timeout``: complete groups still waiting for rewards, and closing them unrewarded.

A group is *overdue* when it is ``open``, has at least ``min_group_size`` trajectories, some
of them have no reward, and nothing happened to any of them (a call or a reward) for the
timeout. The proxy then has it judged, or closes it ``unrewarded``: it never trains, and a
reward posted later is recorded but changes nothing (``proxy.judge._timeout``).
"""

from __future__ import annotations

import time

from sqlalchemy import and_, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from store._lifecycle import GroupState, move
from store._tables import groups as G
from store._tables import trajectories as T

_BATCH = 64


class RewardTimeouts:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def overdue(self, policy: str, *, min_group_size: int, timeout_s: float) -> list[str]:
        """Open groups of ``policy`` that waited ``timeout_s`` for their missing rewards, oldest first."""
        cutoff = time.time() - timeout_s
        size = func.count(T.c.pk)
        query = (
            select(G.c.id)
            .select_from(G.join(T, T.c.group_id == G.c.id))
            .where(G.c.policy == policy, G.c.state == GroupState.OPEN.value)
            .group_by(G.c.id, G.c.created_at)
            .having(
                and_(
                    size >= min_group_size,
                    func.count(T.c.reward) < size,
                    func.max(T.c.updated_at) < cutoff,
                    func.coalesce(func.max(T.c.rewarded_at), 0.0) < cutoff,
                )
            )
            .order_by(G.c.created_at)
            .limit(_BATCH)
        )
        async with self._engine.connect() as conn:
            return [str(row[0]) for row in (await conn.execute(query)).all()]

    async def close_unrewarded(self, group_id: str) -> bool:
        """``open`` → ``unrewarded``; False when the group moved on meanwhile (a job took it, a replica closed it)."""
        async with self._engine.begin() as conn:
            return bool(await move(conn, G, G.c.id == group_id, GroupState.OPEN, GroupState.UNREWARDED))

    async def unrewarded(self, policy: str) -> int:
        """How many groups of ``policy`` were closed unrewarded."""
        async with self._engine.connect() as conn:
            query = select(func.count()).where(G.c.policy == policy, G.c.state == GroupState.UNREWARDED.value)
            return int((await conn.execute(query)).scalar_one())
