"""What the data API and the dashboard read: trajectories, calls, rewards and groups, in pages.

Every function returns plain dicts (column -> value); the proxy shapes them for the wire.
Pages are keyset cursors: trajectories by descending key, groups by descending
(created_at, id), so a page is stable while new rows arrive.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, case, func, or_, select
from sqlalchemy.ext.asyncio import AsyncEngine

from store._compact import expand
from store._jobs import ready_condition
from store._lifecycle import GroupState
from store._rewards import RewardRecord, not_by_a_person
from store._tables import calls as C
from store._tables import groups as G
from store._tables import rewards as R
from store._tables import trajectories as T
from tracetrain_core import call_reply

_REWARD_SHOWN = 1e6  # the bound on posted rewards (proxy.data._wire.SCORE_LIMIT): what group statistics read
# What a group's ``state`` filter may say: the stored states plus "ready", derived.
GROUP_VIEW_STATES = ("open", "ready", *(s.value for s in GroupState if s is not GroupState.OPEN))


@dataclass(frozen=True, slots=True)
class TrajectoryFilter:
    group_id: str | None = None
    policy: str | None = None
    rewarded: bool | None = None
    version: int | None = None
    created_after: float | None = None
    created_before: float | None = None
    # Only these policies' (a key confined to some policies reads only theirs); None: every policy.
    policies: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class TrajectoryRecord:
    trajectory: dict[str, Any]
    calls: list[dict[str, Any]]  # in the order they were made
    rewards: list[RewardRecord]  # every reward it got, oldest first


@dataclass(frozen=True, slots=True)
class GroupRecord:
    group: dict[str, Any]
    members: list[dict[str, Any]]  # its trajectories, oldest first
    last_replies: dict[str, dict[str, Any] | None]  # trajectory id -> its last call's reply, as a chat message


class Reads:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def trajectories(self, where: TrajectoryFilter, *, limit: int, after: int | None) -> list[dict[str, Any]]:
        """Newest first; ``limit + 1`` rows so the caller knows whether there is more."""
        query = select(T).order_by(T.c.pk.desc()).limit(limit + 1)
        if where.version is not None:
            query = query.where(T.c.last_version == where.version)
        if where.created_after is not None:
            query = query.where(T.c.created_at >= where.created_after)
        if where.created_before is not None:
            query = query.where(T.c.created_at < where.created_before)
        if where.group_id is not None:
            query = query.where(T.c.group_id == where.group_id)
        if where.policy is not None:
            query = query.where(T.c.policy == where.policy)
        if where.policies is not None:
            query = query.where(T.c.policy.in_(sorted(where.policies)))
        if where.rewarded is not None:
            query = query.where(T.c.reward.is_not(None) if where.rewarded else T.c.reward.is_(None))
        if after is not None:
            query = query.where(T.c.pk < after)
        async with self._engine.connect() as conn:
            return [dict(row._mapping) for row in (await conn.execute(query)).all()]

    async def trajectory(self, trajectory_id: str) -> TrajectoryRecord | None:
        async with self._engine.connect() as conn:
            row = (await conn.execute(select(T).where(T.c.id == trajectory_id))).first()
            if row is None:
                return None
            calls = await conn.execute(
                select(C).where(C.c.trajectory_id == trajectory_id).order_by(C.c.started_at, C.c.pk)
            )
            rewards = await conn.execute(select(R).where(R.c.trajectory_id == trajectory_id).order_by(R.c.pk))
            return TrajectoryRecord(
                dict(row._mapping),
                expand([dict(c._mapping) for c in calls.all()]),
                [RewardRecord.of_row(dict(r._mapping)) for r in rewards.all()],
            )

    async def groups(
        self,
        *,
        min_group_size: int,
        policy: str | None,
        state: str | None,
        limit: int,
        after: tuple[float, str] | None,
        policies: frozenset[str] | None = None,
        min_group_sizes: Mapping[str, int] | None = None,
    ) -> list[dict[str, Any]]:
        """Groups with size, rewards and ``view_state`` (their state, or "ready"); ``limit + 1`` rows.

        ``policies``: only these policies' groups (None: every policy's). ``min_group_sizes``: the policies
        whose groups are ready at another size than ``min_group_size``.
        """
        size = func.count(T.c.pk)
        n_rewarded = func.count(T.c.reward)
        # Read clipped to the bound posted rewards have (the proxy's SCORE_LIMIT): a row written before it
        # existed may hold any double, and summed or squared that overflows (Postgres raises, SQLite gives inf).
        reward = case((T.c.reward > _REWARD_SHOWN, _REWARD_SHOWN), (T.c.reward < -_REWARD_SHOWN, -_REWARD_SHOWN),
                      else_=T.c.reward)  # fmt: skip
        ready = ready_condition(min_group_size, min_group_sizes)
        query = (
            select(
                G.c.id,
                G.c.policy,
                G.c.created_at,
                G.c.state,
                size.label("size"),
                n_rewarded.label("n_rewarded"),
                func.avg(reward).label("reward_mean"),
                func.avg(reward * reward).label("reward_sq_mean"),
                case((ready, "ready"), else_=G.c.state).label("view_state"),
            )
            .select_from(G.outerjoin(T, T.c.group_id == G.c.id))
            .group_by(G.c.id, G.c.policy, G.c.created_at, G.c.state)
            .order_by(G.c.created_at.desc(), G.c.id.desc())
            .limit(limit + 1)
        )
        if policy is not None:
            query = query.where(G.c.policy == policy)
        if policies is not None:
            query = query.where(G.c.policy.in_(sorted(policies)))
        if state == "ready":
            query = query.having(ready)
        elif state == GroupState.OPEN.value:
            query = query.where(G.c.state == state).having(~ready)
        elif state is not None:
            query = query.where(G.c.state == state)
        if after is not None:
            created_at, group = after
            query = query.where(or_(G.c.created_at < created_at, and_(G.c.created_at == created_at, G.c.id < group)))
        async with self._engine.connect() as conn:
            return [dict(row._mapping) for row in (await conn.execute(query)).all()]

    async def group(self, group_id: str) -> GroupRecord | None:
        async with self._engine.connect() as conn:
            group = (await conn.execute(select(G).where(G.c.id == group_id))).first()
            if group is None:
                return None
            members = await conn.execute(select(T).where(T.c.group_id == group_id).order_by(T.c.created_at))
            calls = await conn.execute(
                select(C.c.trajectory_id, C.c.endpoint, C.c.response)
                .where(C.c.group_id == group_id)
                .order_by(C.c.started_at, C.c.pk)
            )
            # The last call of each wins; its reply read alike whatever API it spoke.
            last = {row.trajectory_id: call_reply(row.endpoint, row.response) for row in calls.all()}
            return GroupRecord(dict(group._mapping), [dict(m._mapping) for m in members.all()], last)

    async def review_queue(self, policy: str, *, limit: int, after: int | None) -> list[dict[str, Any]]:
        """What awaits a person's score, oldest first: trajectories with a recorded call that no person has
        scored, in a group still open (its rewards may still train). ``limit + 1`` rows; keyset on the key."""
        query = self._awaiting(policy).order_by(T.c.pk).limit(limit + 1)
        if after is not None:
            query = query.where(T.c.pk > after)
        async with self._engine.connect() as conn:
            return [dict(row._mapping) for row in (await conn.execute(query)).all()]

    async def trajectory_key(self, trajectory_id: str) -> tuple[int, str] | None:
        """A trajectory's key (its place in keyset order) and its policy, or None."""
        async with self._engine.connect() as conn:
            row = (await conn.execute(select(T.c.pk, T.c.policy).where(T.c.id == trajectory_id))).first()
        return None if row is None else (int(row[0]), str(row[1]))

    async def review_neighbours(self, policy: str, trajectory_pk: int) -> tuple[str | None, str | None]:
        """(previous, next) trajectory ids in the review queue around the trajectory with key ``trajectory_pk``."""
        before = self._awaiting(policy).where(T.c.pk < trajectory_pk).order_by(T.c.pk.desc()).limit(1)
        after = self._awaiting(policy).where(T.c.pk > trajectory_pk).order_by(T.c.pk).limit(1)
        async with self._engine.connect() as conn:
            previous = (await conn.execute(before)).first()
            following = (await conn.execute(after)).first()
        return (previous.id if previous else None), (following.id if following else None)

    async def review_count(self, policy: str) -> int:
        query = self._awaiting(policy).with_only_columns(func.count()).order_by(None)
        async with self._engine.connect() as conn:
            return int((await conn.execute(query)).scalar_one())

    @staticmethod
    def _awaiting(policy: str) -> Any:
        return (
            select(T)
            .select_from(T.join(G, G.c.id == T.c.group_id))
            .where(T.c.policy == policy, T.c.n_calls > 0, not_by_a_person(), G.c.state == GroupState.OPEN.value)
        )

    async def traffic(self) -> dict[str, int]:
        """Calls in the last minute and five minutes; trajectories in all and rewarded."""
        now = time.time()
        async with self._engine.connect() as conn:
            last_minute = (await conn.execute(select(func.count()).where(C.c.started_at >= now - 60))).scalar_one()
            last_5 = (await conn.execute(select(func.count()).where(C.c.started_at >= now - 300))).scalar_one()
            total, rewarded = (await conn.execute(select(func.count(T.c.pk), func.count(T.c.reward)))).one()
        return {"calls_last_minute": int(last_minute), "calls_last_5_minutes": int(last_5),
                "trajectories": int(total), "rewarded": int(rewarded)}  # fmt: skip
