"""Retention of data (off by default): old trajectories deleted with their calls, rewards and judgements.

``--keep-trajectories DAYS`` (``tracetrain serve``) or ``tracetrain db prune`` select the
trajectories whose last call is older than the cut-off (or, with a count, all but the newest
N), and delete them in batches of ``batch`` trajectories, one short transaction each, so the
capture writer waits at most one batch for SQLite's lock. Never deleted:

- a trajectory whose group is ``open`` or ``training``: it may still be trained on;
- a trajectory touched in the last ``MIN_AGE_S``: its calls may be the reference of a call
  being captured now (``store._compact`` uses references at most ``MAX_REFERENCE_AGE_S`` old).

Whole trajectories go (every call with them), so a compact call's reference is never deleted
before it. Groups left with no trajectory go too, with their judgements; training jobs stay
(history, like pruned adapter versions). ``tracetrain export`` before a prune is the archive.

SQLite keeps freed pages for reuse: the file shrinks only with ``vacuum`` (``tracetrain db
prune --vacuum``), which rewrites it and needs as much free space as the file. PostgreSQL's
autovacuum makes the space reusable; ``VACUUM FULL`` returns it to the system (an operator's call).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Table, delete, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from store._compact import MAX_REFERENCE_AGE_S
from store._lifecycle import GroupState
from store._tables import calls as C
from store._tables import groups as G
from store._tables import judgements as JG
from store._tables import rewards as R
from store._tables import trajectories as T

# Twice the age of the oldest reference a capture may still write against, so a prune never races one.
MIN_AGE_S = 2 * MAX_REFERENCE_AGE_S
_KEPT_GROUPS = (GroupState.OPEN.value, GroupState.TRAINING.value)


@dataclass(frozen=True, slots=True)
class PruneRule:
    """What goes: trajectories last touched before ``before`` (unix time), or beyond the newest ``keep_last``."""

    before: float | None = None
    keep_last: int | None = None
    policy: str | None = None

    def __post_init__(self) -> None:
        if (self.before is None) == (self.keep_last is None):
            raise ValueError("a prune rule is an age or a count, one of them")
        if self.keep_last is not None and self.keep_last < 0:
            raise ValueError("keep_last must be 0 or more")


@dataclass(slots=True)
class PruneReport:
    trajectories: int = 0
    calls: int = 0
    rewards: int = 0
    groups: int = 0
    judgements: int = 0
    batches: int = 0
    trajectory_ids: list[str] = field(default_factory=list, repr=False)  # what went (the proxy's memory forgets it)


async def _candidates(engine: AsyncEngine, rule: PruneRule, limit: int, now: float) -> list[str]:
    query = (
        select(T.c.id)
        .select_from(T.join(G, G.c.id == T.c.group_id, isouter=True))
        .where(
            T.c.updated_at < now - MIN_AGE_S,
            (G.c.state.is_(None)) | (G.c.state.not_in(_KEPT_GROUPS)),
        )
        .order_by(T.c.pk)
        .limit(limit)
    )
    if rule.policy is not None:
        query = query.where(T.c.policy == rule.policy)
    async with engine.connect() as conn:
        if rule.before is not None:
            query = query.where(T.c.updated_at < rule.before)
        else:
            newest = select(T.c.pk).order_by(T.c.pk.desc()).limit(rule.keep_last)
            if rule.policy is not None:
                newest = newest.where(T.c.policy == rule.policy)
            query = query.where(T.c.pk.not_in(newest.scalar_subquery()))
        return [str(row.id) for row in (await conn.execute(query)).all()]


async def prune_trajectories(
    engine: AsyncEngine, rule: PruneRule, *, batch: int = 200, dry_run: bool = False, pause_s: float = 0.0
) -> PruneReport:
    """Delete what ``rule`` selects, ``batch`` trajectories per transaction; ``dry_run`` counts it only."""
    report = PruneReport()
    now = time.time()
    if dry_run:
        ids = await _candidates(engine, rule, 2**62, now)
        async with engine.connect() as conn:
            for chunk in _chunks(ids, 500):
                report.calls += int((await conn.execute(_count(C, chunk))).scalar_one())
                report.rewards += int((await conn.execute(_count(R, chunk))).scalar_one())
        report.trajectories, report.trajectory_ids = len(ids), ids
        return report
    while ids := await _candidates(engine, rule, batch, now):
        async with engine.begin() as conn:
            report.calls += (await conn.execute(delete(C).where(C.c.trajectory_id.in_(ids)))).rowcount
            report.rewards += (await conn.execute(delete(R).where(R.c.trajectory_id.in_(ids)))).rowcount
            report.trajectories += (await conn.execute(delete(T).where(T.c.id.in_(ids)))).rowcount
            empty = select(G.c.id).where(
                G.c.state.not_in(_KEPT_GROUPS), ~select(T.c.pk).where(T.c.group_id == G.c.id).exists()
            )
            emptied = [str(g) for g in (await conn.execute(empty)).scalars()]
            if emptied:
                report.judgements += (await conn.execute(delete(JG).where(JG.c.group_id.in_(emptied)))).rowcount
                report.groups += (await conn.execute(delete(G).where(G.c.id.in_(emptied)))).rowcount
        report.trajectory_ids += ids
        report.batches += 1
        await asyncio.sleep(pause_s)  # the capture writer takes SQLite's lock between batches
    return report


def _count(table: Table, ids: list[str]) -> Any:
    return select(func.count()).where(table.c.trajectory_id.in_(ids))


def _chunks(ids: list[str], size: int) -> list[list[str]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


async def vacuum(engine: AsyncEngine) -> None:
    """Give freed space back to the filesystem: SQLite rewrites its file; PostgreSQL runs a plain VACUUM."""
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text("VACUUM"))
        if engine.dialect.name == "sqlite":  # the rewritten pages are in the WAL: copy them back, shrinking the file
            await conn.execute(text("PRAGMA wal_checkpoint(TRUNCATE)"))
