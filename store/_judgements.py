"""The judge's reads and writes: a group's conversations, cached verdicts, scores written whole.

A judgement's scores are written in one transaction with its ``judgements`` row, or not
at all: if the group changed while it was judged (a trajectory joined or moved on), or a
job took it, ``GroupChanged`` is raised and nothing but a failed judgement is recorded.

Proxy replicas sharing the store judge a group one at a time: a judge first claims the
group (``claim``: ``judge_owner`` and a lease on the group's row, taken with a guarded
``UPDATE``), renews the lease while the judge model thinks, and writes its scores only
while the claim is still its own. A replica that died while judging leaves a claim that
runs out, and any replica may then claim the group.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, bindparam, func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from store._compact import expand
from store._errors import StoreError
from store._lifecycle import GroupState
from store._rewards import RewardRecord, not_by_a_person
from store._tables import calls as C
from store._tables import groups as G
from store._tables import judgements as JG
from store._tables import rewards as R
from store._tables import trajectories as T

JUDGEMENT_STATES = ("ok", "failed")
_SCAN_BATCH = 32


class GroupChanged(StoreError):
    """The group changed while it was judged; nothing was written."""


@dataclass(frozen=True, slots=True)
class GroupCalls:
    """A group as the judge reads it: its state and each trajectory's calls, in order."""

    state: str
    calls: dict[str, list[dict[str, Any]]]  # trajectory id -> [{"endpoint", "request", "response", "error"}]
    policy: str


@dataclass(frozen=True, slots=True)
class DueRule:
    """When a group is due for judging (see ``proxy.judge._service`` for the rules in words)."""

    policy: str
    scores_are_rewards: bool  # --reward-source judge
    group_size: int
    min_group_size: int
    quiet_s: float
    idle_s: float
    horizon_s: float


class Judgements:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def group_calls(self, group_id: str) -> GroupCalls | None:
        async with self._engine.connect() as conn:
            group = (await conn.execute(select(G.c.state, G.c.policy).where(G.c.id == group_id))).first()
            if group is None:
                return None
            trajectories = (
                await conn.execute(select(T.c.id).where(T.c.group_id == group_id).order_by(T.c.created_at, T.c.pk))
            ).all()
            calls = (
                await conn.execute(
                    select(C.c.trajectory_id, C.c.endpoint, C.c.request, C.c.response, C.c.error, C.c.id,
                           C.c.prefix_of, C.c.prefix_messages)
                    .where(C.c.group_id == group_id)
                    .order_by(C.c.started_at, C.c.pk)
                )
            ).all()  # fmt: skip
        by_trajectory: dict[str, list[dict[str, Any]]] = {row.id: [] for row in trajectories}
        for row in expand([dict(call._mapping) for call in calls]):
            if row.pop("id") and row["trajectory_id"] in by_trajectory:
                by_trajectory[row["trajectory_id"]].append(row)
        return GroupCalls(str(group.state), by_trajectory, str(group.policy))

    async def cached_scores(self, cache_key: str) -> list[dict[str, Any]] | None:
        """The scores of the newest ok judgement that asked the same thing."""
        async with self._engine.connect() as conn:
            row = (
                await conn.execute(
                    select(JG.c.scores)
                    .where(JG.c.cache_key == cache_key, JG.c.state == "ok")
                    .order_by(JG.c.id.desc())
                    .limit(1)
                )
            ).first()
        return None if row is None else list(row.scores)

    async def claim(self, group_id: str, owner: str, lease_s: float) -> bool:
        """Claim ``group_id`` for judging; False while another judge's claim on it runs."""
        now = time.time()
        free = G.c.judge_owner.is_(None) | G.c.judge_lease_expires_at.is_(None) | (G.c.judge_lease_expires_at < now)
        async with self._engine.begin() as conn:
            taken = await conn.execute(
                update(G)
                .where(G.c.id == group_id, free)
                .values(judge_owner=owner, judge_lease_expires_at=now + lease_s)
            )
        return bool(taken.rowcount)

    async def renew(self, group_id: str, owner: str, lease_s: float) -> bool:
        """Extend the claim while the judge thinks; False once it is no longer ``owner``'s."""
        async with self._engine.begin() as conn:
            renewed = await conn.execute(
                update(G).where(G.c.id == group_id, G.c.judge_owner == owner)
                .values(judge_lease_expires_at=time.time() + lease_s)
            )  # fmt: skip
        return bool(renewed.rowcount)

    async def release(self, group_id: str, owner: str) -> None:
        """Give the claim back (the judgement is written, or failed)."""
        async with self._engine.begin() as conn:
            await conn.execute(
                update(G).where(G.c.id == group_id, G.c.judge_owner == owner)
                .values(judge_owner=None, judge_lease_expires_at=None)
            )  # fmt: skip

    async def write_scores(
        self, row: dict[str, Any], judged: Sequence[str], *, scores_are_rewards: bool, owner: str
    ) -> list[RewardRecord]:
        """The scores as ``rewards`` rows (and, if they are the rewards, the trajectories'), with the judgement.

        Returns the rewards written. Raises ``GroupChanged`` if the group is not as it was judged,
        or if ``owner``'s claim on it was taken over.
        """
        now = time.time()
        group_id = row["group_id"]
        rewards = [
            RewardRecord(s["trajectory_id"], group_id, s["score"], {}, "judge", s["explanation"], now)
            for s in row["scores"]
        ]
        async with self._engine.begin() as conn:
            # Locks the group's row until the commit: nobody takes the claim over meanwhile.
            still_mine = await conn.execute(
                update(G).where(G.c.id == group_id, G.c.judge_owner == owner).values(judge_owner=owner)
            )
            if not still_mine.rowcount:
                raise GroupChanged("another replica took over judging the group (this one's claim ran out)")
            state = (await conn.execute(select(G.c.state).where(G.c.id == group_id))).scalar_one()
            present = (await conn.execute(select(T.c.id, T.c.updated_at).where(T.c.group_id == group_id))).all()
            moved_on = any(r.updated_at > row["started_at"] for r in present)
            if sorted(r.id for r in present) != sorted(judged) or moved_on:
                raise GroupChanged("the group changed while it was judged; it will be judged again")
            if scores_are_rewards and state != GroupState.OPEN.value:
                raise GroupChanged(f"the group became {state} while it was judged; its rewards were left as they were")
            await conn.execute(insert(R), [reward.row() for reward in rewards])
            if scores_are_rewards:
                await conn.execute(
                    update(T)
                    .where(T.c.id == bindparam("b_id"), not_by_a_person())  # a person's score stays
                    .values(
                        reward=bindparam("b_r"),
                        reward_source="judge",
                        reward_note=bindparam("b_note"),
                        rewarded_at=now,
                        tail_hash=None,
                    ),
                    # In key order, as every writer of trajectories (no deadlock between replicas).
                    [
                        {"b_id": s["trajectory_id"], "b_r": s["score"], "b_note": s["explanation"]}
                        for s in sorted(row["scores"], key=lambda s: str(s["trajectory_id"]))
                    ],
                )
            row |= {"state": "ok", "finished_at": now}
            row["id"] = (await conn.execute(insert(JG).values(**row).returning(JG.c.id))).scalar_one()
        return rewards

    async def record(self, row: dict[str, Any]) -> int:
        """A judgement row as it is (a failed one: nothing else is written)."""
        async with self._engine.begin() as conn:
            return int((await conn.execute(insert(JG).values(**row).returning(JG.c.id))).scalar_one())

    async def find(self, *, group_id: str | None, state: str | None, limit: int) -> list[dict[str, Any]]:
        """Judgements, newest first."""
        query = select(JG).order_by(JG.c.id.desc()).limit(limit)
        if group_id is not None:
            query = query.where(JG.c.group_id == group_id)
        if state is not None:
            query = query.where(JG.c.state == state)
        async with self._engine.connect() as conn:
            return [dict(r._mapping) for r in (await conn.execute(query)).all()]

    async def due(self, rule: DueRule, group_id: str | None = None) -> list[tuple[str, str]]:
        """(group id, trigger) of the groups to judge now: "complete" when full and quiet, else "idle".

        With ``group_id``: that group if it is due (a judge asks again once it holds the claim,
        since another replica may have judged it since the scan).
        """
        now = time.time()
        size = func.count(T.c.pk)
        n_rewarded = func.count(T.c.reward)
        last = func.max(T.c.updated_at)

        def newest(state: str) -> Any:
            return (
                select(func.max(JG.c.started_at))
                .where(JG.c.group_id == G.c.id, JG.c.state == state)
                .correlate(G)
                .scalar_subquery()
            )

        last_ok, last_failed = newest("ok"), newest("failed")
        quiet = last < now - rule.quiet_s
        full = and_(size >= rule.group_size, quiet)
        if rule.scores_are_rewards:
            wanted = n_rewarded < size
        else:
            wanted = last > func.coalesce(last_ok, 0.0)
            full = or_(full, and_(n_rewarded == size, quiet))
        not_failing = or_(last_failed.is_(None), last_failed < now - rule.idle_s, last > last_failed)
        query = (
            select(G.c.id, and_(full).label("full"))
            .select_from(G.join(T, T.c.group_id == G.c.id))
            .where(G.c.policy == rule.policy, G.c.created_at > now - rule.horizon_s)
            .group_by(G.c.id, G.c.created_at)
            .having(and_(size >= rule.min_group_size, wanted, or_(full, last < now - rule.idle_s), not_failing))
            .order_by(G.c.created_at)
            .limit(_SCAN_BATCH)
        )
        if rule.scores_are_rewards:
            query = query.where(G.c.state == GroupState.OPEN.value)
        if group_id is not None:
            query = query.where(G.c.id == group_id)
        async with self._engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [(row[0], "complete" if row[1] else "idle") for row in rows]
