"""The regression guard's reads and writes: rewards by serving version, rollback, pause and resume.

The guard itself (when to roll back) lives in ``proxy.training._guard``; here is what it
reads and writes, each write one transaction:

- ``group_means``: the mean reward of each complete group over its trajectories that one
  version served entirely (every call of the trajectory has that ``calls.version``). A
  group counts once all its trajectories are rewarded and it was not closed unrewarded.
- ``roll_back``: the alias flips back from the bad version (only if it still serves it: two
  replicas cannot both win), the adapter becomes ``rolled_back`` with the verdict, the
  policy's training is ``paused`` with the reason, and queued jobs are cancelled (their
  groups open again, to train once training resumes). A job already running finishes; its
  adapter is discarded by ``discard_stale`` instead of published.
- ``pause``: training stops for a reason other than a rollback (the shared GPU's hand-over gave
  up: vLLM would not sleep); queued jobs are cancelled as in ``roll_back``.
- ``resume``: an admin's ``paused`` → ``active``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import exists, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from store._lifecycle import AdapterState, GroupState, JobState, TrainingState, move
from store._tables import adapters as A
from store._tables import calls as C
from store._tables import groups as G
from store._tables import policies as P
from store._tables import training_jobs as J
from store._tables import trajectories as T

TRAINING_FIELDS = ("training", "training_reason", "paused_at", "rolled_back_at")
_T2 = T.alias("t2")


class Guards:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def training(self, policy: str) -> dict[str, Any]:
        """The policy's training state: ``training`` ("active" or "paused"), its reason and times."""
        async with self._engine.connect() as conn:
            row = (await conn.execute(select(*(P.c[f] for f in TRAINING_FIELDS)).where(P.c.name == policy))).first()
        if row is None:
            return {"training": TrainingState.ACTIVE.value, "training_reason": None, "paused_at": None,
                    "rolled_back_at": None}  # fmt: skip
        return dict(row._mapping)

    async def group_means(
        self, policy: str, versions: Sequence[int], *, limit: int, newest_first: bool, since: float = 0.0
    ) -> list[tuple[int, float]]:
        """(version, mean reward) of complete groups served by one of ``versions``, by completion time.

        A group whose trajectories several of these versions served counts once per version.
        """
        served_by_other = exists().where(C.c.trajectory_id == T.c.id, C.c.version != T.c.last_version)
        unrewarded_member = exists().where(_T2.c.group_id == T.c.group_id, _T2.c.reward.is_(None))
        closed = select(G.c.id).where(G.c.policy == policy, G.c.state == GroupState.UNREWARDED.value)
        done = func.max(T.c.rewarded_at)
        query = (
            select(T.c.last_version, func.avg(T.c.reward))
            .where(
                T.c.policy == policy,
                T.c.last_version.in_(list(versions)),
                T.c.reward.is_not(None),
                T.c.created_at >= since,
                ~served_by_other,
                ~unrewarded_member,
                T.c.group_id.not_in(closed),
            )
            .group_by(T.c.group_id, T.c.last_version)
            .order_by(done.desc() if newest_first else done, T.c.group_id)
            .limit(limit)
        )
        async with self._engine.connect() as conn:
            return [(int(v), float(m)) for v, m in (await conn.execute(query)).all()]

    async def watch(self, policy: str, version: int, guard: dict[str, Any]) -> None:
        """Start (or update) the guard's record of ``version``."""
        async with self._engine.begin() as conn:
            await conn.execute(update(A).where(A.c.policy == policy, A.c.version == version).values(guard=guard))

    async def watched(self, policy: str) -> list[dict[str, Any]]:
        """Versions the guard still watches (``guard.state`` "watching"), oldest first."""
        async with self._engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(A.c.version, A.c.state, A.c.guard, A.c.published_at)
                    .where(A.c.policy == policy, A.c.guard.is_not(None))
                    .order_by(A.c.version)
                )
            ).all()
        return [dict(r._mapping) for r in rows if (r.guard or {}).get("state") == "watching"]

    async def rolled_back_versions(self, policy: str) -> set[int]:
        async with self._engine.connect() as conn:
            rows = await conn.execute(
                select(A.c.version).where(A.c.policy == policy, A.c.state == AdapterState.ROLLED_BACK.value)
            )
            return {int(v) for v in rows.scalars()}

    async def roll_back(self, policy: str, bad: int, to: int, reason: str, guard: dict[str, Any]) -> bool:
        """Serve ``to`` instead of ``bad``, mark ``bad`` rolled back, pause training; False if it lost a race."""
        now = time.time()
        async with self._engine.begin() as conn:
            flipped = await conn.execute(
                update(P).where(P.c.name == policy, P.c.active_version == bad).values(active_version=to, updated_at=now)
            )
            if not flipped.rowcount:
                return False  # another replica (or an admin) moved the alias first
            await move(conn, A, (A.c.policy == policy) & (A.c.version == bad), AdapterState.PUBLISHED,
                       AdapterState.ROLLED_BACK, guard=guard, error=reason)  # fmt: skip
            await move(conn, P, P.c.name == policy, TrainingState.ACTIVE, TrainingState.PAUSED, column="training",
                       training_reason=reason, paused_at=now)  # fmt: skip
            await conn.execute(update(P).where(P.c.name == policy).values(rolled_back_at=now))
            await _cancel_queued(conn, policy, now, "cancelled: the regression guard paused training")
        return True

    async def pause(self, policy: str, reason: str) -> bool:
        """Pause the policy's training with ``reason`` and cancel its queued jobs; False when it was not active."""
        now = time.time()
        async with self._engine.begin() as conn:
            paused = await move(conn, P, P.c.name == policy, TrainingState.ACTIVE, TrainingState.PAUSED,
                                column="training", training_reason=reason, paused_at=now)  # fmt: skip
            if paused:
                await _cancel_queued(conn, policy, now, f"cancelled: training paused ({reason})")
        return bool(paused)

    async def resume(self, policy: str) -> bool:
        """An admin resumes training; False when it was not paused."""
        async with self._engine.begin() as conn:
            return bool(
                await move(conn, P, P.c.name == policy, TrainingState.PAUSED, TrainingState.ACTIVE, column="training",
                           training_reason=None, paused_at=None)
            )  # fmt: skip

    async def discard_stale(self, policy: str) -> list[tuple[int, str]]:
        """Discard the trained adapters that must not be published (their jobs fail); (version, why) of each.

        While training is paused every trained adapter is discarded; after a rollback, those
        whose step started before it (they continued from the version rolled back).
        """
        now = time.time()
        async with self._engine.begin() as conn:
            state = (await conn.execute(select(P.c.training, P.c.rolled_back_at).where(P.c.name == policy))).first()
            if state is None:
                return []
            paused = state.training == TrainingState.PAUSED.value
            if not paused and state.rolled_back_at is None:
                return []
            rows = (
                await conn.execute(
                    select(A.c.version, A.c.job_id, A.c.created_at, J.c.started_at)
                    .select_from(A.outerjoin(J, J.c.id == A.c.job_id))
                    .where(A.c.policy == policy, A.c.state == AdapterState.TRAINED.value)
                )
            ).all()
            discarded = []
            for version, job_id, created_at, started_at in rows:
                began = started_at if started_at is not None else created_at
                if paused:
                    why = "not published: training is paused by the regression guard"
                elif began < state.rolled_back_at:
                    why = "not published: its step continued from a version that was rolled back"
                else:
                    continue
                where = (A.c.policy == policy) & (A.c.version == version)
                if await move(conn, A, where, AdapterState.TRAINED, AdapterState.DISCARDED, error=why):
                    discarded.append((int(version), why))
                    if job_id is not None:
                        await move(conn, J, J.c.id == job_id, JobState.SUCCEEDED, JobState.FAILED, error=why,
                                   finished_at=now)  # fmt: skip
        return discarded


async def _cancel_queued(conn: AsyncConnection, policy: str, now: float, why: str) -> None:
    """Fail the policy's queued jobs with ``why``; their groups open again, to train once training resumes."""
    queued = (
        await conn.execute(
            select(J.c.id, J.c.group_ids).where(J.c.policy == policy, J.c.state == JobState.QUEUED.value)
        )
    ).all()
    for job_id, group_ids in queued:
        if await move(conn, J, J.c.id == job_id, JobState.QUEUED, JobState.FAILED, finished_at=now, error=why):
            await move(conn, G, G.c.id.in_(list(group_ids)), GroupState.TRAINING, GroupState.OPEN, job_id=None)
