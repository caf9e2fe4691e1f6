"""Derived groups shared by proxy replicas: a task's attempts fill one group, seat by seat.

A group the client leaves unnamed is derived from the task (``task_key``): the same task
asked N times forms one GRPO group of at most ``group_size`` trajectories, then the next
group of the task opens. Several replicas key calls at once, so the store decides, in one
short transaction per new trajectory:

1. if the task's newest group is open and has a free seat, take it: ``UPDATE groups SET
   seats = seats + 1 WHERE id = :newest AND state = 'open' AND seats < :group_size`` (a
   guarded update: the row count says whether this replica got the seat; Postgres re-checks
   the condition after a concurrent update, SQLite runs writers one at a time);
2. else open the task's next group, numbered after the newest, with ``INSERT ... ON CONFLICT
   (policy, task_key, task_seq) DO NOTHING``: of replicas opening it together, one inserts
   and the others look again and take a seat in it;
3. insert the trajectory row (``ON CONFLICT (id) DO NOTHING``): if another replica keyed
   the same new trajectory first, this transaction rolls back (the seat is given back) and
   the trajectory's group is the one already stored, or ``KeyTaken`` when another policy keyed it.

A trajectory keyed into a group its call names takes no seat; where replicas may share the store,
``claim_named`` writes both rows at keying all the same, so the first policy to key an id holds it
from its first call on (the proxy's keying: ``proxy.gateway._keying``).

The trajectory row exists from its first call's keying on, with no calls until that call
is recorded (``store._writer``); a seat taken in its call's own record (SQLite, ``CallWrite.seat_in``)
writes the row with that call counted already (``FirstCall``). A seat whose call is never
recorded would keep its group waiting for a reward that cannot come, so it is given back
(``release_seats``: the row, still without calls, deleted and the group's count lowered): by the
writer when the call's record fails, and by a sweep for a seat still without a call after a bound
(``release_stale_seats``: the process that keyed it died before recording).

On SQLite a proxy with capture seats its trajectories on the group-commit writer's thread
(``seat_all_sqlite``): the seats asked while the previous commit ran share one ``BEGIN
IMMEDIATE`` transaction on the writer's own connection. The write lock is held from the first
read, so no other process's writer comes between a read and its write (no lost round, no
rollback), and the proxy's two writers (keying and recording) never wait on each other's lock.
A transaction of its own through aiosqlite cost ~6 ms per new trajectory under load
(docs/BENCHMARKS.md), most of it waiting for the writer thread's lock.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import case, delete, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from store._engine import insert_ignore
from store._errors import KeyTaken, StoreUnavailable
from store._lifecycle import GroupState
from store._tables import groups as G
from store._tables import trajectories as T

_OPEN_STATE = GroupState.OPEN.value  # once: an enum member's value is a Python-level descriptor
_SWEEP = 500  # stale seats released per transaction
# Each round either takes a seat or sees another replica take the last one; many replicas racing
# for the seats of one task need a few rounds at most.
_ROUNDS = 32


class _KeyedElsewhere(Exception):
    """The trajectory was stored by another replica meanwhile: roll back, use its group."""


async def join_task_group(
    engine: AsyncEngine, *, policy: str, task_key: str, trajectory_id: str, keyed_by: str, group_size: int,
    now: float,
) -> str:  # fmt: skip
    """The group (derived from ``task_key``) that ``trajectory_id`` belongs to, taking a seat for it."""
    dialect = engine.dialect.name
    trajectory = {"id": trajectory_id, "policy": policy, "keyed_by": keyed_by, "created_at": now, "updated_at": now,
                  "n_calls": 0, "last_version": 0, "metrics": {}}  # fmt: skip
    for _ in range(_ROUNDS):
        try:
            async with engine.begin() as conn:
                group_id = await _seat(conn, dialect, policy, task_key, group_size, now)
                if group_id is None:
                    continue  # another replica took the last seat, or opened the next group: look again
                joined = await conn.execute(
                    insert_ignore(dialect, T, ["id"]).values(group_id=group_id, **trajectory).returning(T.c.id)
                )
                if joined.first() is None:
                    raise _KeyedElsewhere
                return group_id
        except _KeyedElsewhere:
            async with engine.connect() as conn:
                stored = (await conn.execute(select(T.c.group_id, T.c.policy).where(T.c.id == trajectory_id))).one()
            if stored.policy != policy:
                raise KeyTaken("trajectory", trajectory_id) from None
            return str(stored.group_id)
    raise StoreUnavailable(f"no seat in a group of task {task_key[:12]} after {_ROUNDS} rounds")


async def claim_named(
    engine: AsyncEngine, *, policy: str, trajectory_id: str, group_id: str, keyed_by: str, now: float
) -> str:
    """The group of a new trajectory keyed into ``group_id`` (named by its call), both ids claimed for ``policy``.

    The group's row and the trajectory's (without calls, as a seat: given back if its call is never recorded)
    are written now, ``ON CONFLICT (id) DO NOTHING``, then read: an id another policy took first, on any
    replica, is ``KeyTaken`` and nothing is written. A trajectory this policy stored before keeps its group.
    """
    dialect = engine.dialect.name
    group = {"id": group_id, "policy": policy, "state": GroupState.OPEN.value, "created_at": now}
    trajectory = {"id": trajectory_id, "group_id": group_id, "policy": policy, "keyed_by": keyed_by,
                  "created_at": now, "updated_at": now, "n_calls": 0, "last_version": 0, "metrics": {}}  # fmt: skip
    async with engine.begin() as conn:  # a refusal raised inside rolls both rows back
        await conn.execute(insert_ignore(dialect, G, ["id"]).values(**group))
        if (await conn.execute(select(G.c.policy).where(G.c.id == group_id))).scalar_one() != policy:
            raise KeyTaken("group", group_id)
        await conn.execute(insert_ignore(dialect, T, ["id"]).values(**trajectory))
        stored = (await conn.execute(select(T.c.group_id, T.c.policy).where(T.c.id == trajectory_id))).one()
        if stored.policy != policy:
            raise KeyTaken("trajectory", trajectory_id)
        return str(stored.group_id)


async def _seat(
    conn: AsyncConnection, dialect: str, policy: str, task_key: str, group_size: int, now: float
) -> str | None:
    """A seat in the task's newest group if it is open and not full, else in the next one; None if we lost a race.

    The next group's number comes from the newest group this round saw, not from a later read:
    under Postgres' READ COMMITTED each statement sees newer commits, and a replica that saw group
    N full must not open N + 2 because another replica opened N + 1 in between.
    """
    task = (G.c.policy == policy) & (G.c.task_key == task_key)
    newest = (
        await conn.execute(
            select(G.c.id, G.c.task_seq, G.c.state, G.c.seats).where(task).order_by(G.c.task_seq.desc()).limit(1)
        )
    ).first()
    if newest is not None and newest.state == GroupState.OPEN.value and newest.seats < group_size:
        taken = await conn.execute(
            update(G)
            .where(G.c.id == newest.id, G.c.state == GroupState.OPEN.value, G.c.seats < group_size)
            .values(seats=G.c.seats + 1)
        )
        return str(newest.id) if taken.rowcount else None
    number = (newest.task_seq or 0) + 1 if newest is not None else 1
    group = {"id": f"grp-{task_key[:12]}-{uuid.uuid4().hex[:8]}", "policy": policy, "task_key": task_key,
             "task_seq": number, "seats": 1, "state": GroupState.OPEN.value, "created_at": now}  # fmt: skip
    opened = await conn.execute(
        insert_ignore(dialect, G, ["policy", "task_key", "task_seq"]).values(**group).returning(G.c.id)
    )
    row = opened.first()
    return None if row is None else str(row[0])


@dataclass(frozen=True, slots=True)
class Seat:
    """A new trajectory asking for a seat in its task's derived group."""

    policy: str
    task_key: str
    trajectory_id: str
    keyed_by: str
    group_size: int
    now: float


_STORED_GROUP = "SELECT group_id, policy FROM trajectories WHERE id = ?"
_NEWEST = (
    "SELECT id, task_seq, state, seats FROM groups WHERE policy = ? AND task_key = ? ORDER BY task_seq DESC LIMIT 1"
)
_TAKE = "UPDATE groups SET seats = seats + 1 WHERE id = ?"
_OPEN = "INSERT INTO groups (id, policy, task_key, task_seq, seats, state, created_at) VALUES (?, ?, ?, ?, 1, ?, ?)"
_JOIN = (
    "INSERT INTO trajectories (id, group_id, policy, keyed_by, created_at, updated_at, n_calls, last_version,"
    " tail_hash, metrics) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, '{}')"
)


def seat_all_sqlite(conn: sqlite3.Connection, seats: Sequence[Seat]) -> list[str]:
    """The group of each trajectory in ``seats``, seated in order in one IMMEDIATE transaction (SQLite)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        groups = [seat_one_sqlite(conn, seat)[0] for seat in seats]
    except BaseException:
        conn.rollback()
        raise
    conn.commit()
    return groups


@dataclass(frozen=True, slots=True)
class FirstCall:
    """What a new trajectory's row holds once its first call is recorded: written with the seat when both go
    in one transaction (``store._batch``), instead of a row inserted empty and updated at once."""

    updated_at: float
    version: int
    tail_hash: str | None


def seat_one_sqlite(conn: sqlite3.Connection, seat: Seat, first: FirstCall | None = None) -> tuple[str, bool]:
    """``seat``'s group, inside the caller's transaction, and whether its trajectory's row was written now (with
    ``first``'s values and one call, where given; else empty) rather than found stored."""
    stored = conn.execute(_STORED_GROUP, (seat.trajectory_id,)).fetchone()
    if stored is not None:  # keyed first by another call of it, here or on another replica
        if stored[1] != seat.policy:
            raise KeyTaken("trajectory", seat.trajectory_id)
        return str(stored[0]), False
    newest = conn.execute(_NEWEST, (seat.policy, seat.task_key)).fetchone()
    if newest is not None and newest[2] == _OPEN_STATE and newest[3] < seat.group_size:
        group_id = str(newest[0])
        conn.execute(_TAKE, (group_id,))
    else:
        number = (newest[1] or 0) + 1 if newest is not None else 1
        group_id = f"grp-{seat.task_key[:12]}-{uuid.uuid4().hex[:8]}"
        conn.execute(_OPEN, (group_id, seat.policy, seat.task_key, number, _OPEN_STATE, seat.now))
    row = (seat.now, 0, 0, None) if first is None else (first.updated_at, 1, first.version, first.tail_hash)
    conn.execute(_JOIN, (seat.trajectory_id, group_id, seat.policy, seat.keyed_by, seat.now, *row))
    return group_id, True


async def release_seats(engine: AsyncEngine, trajectory_ids: Sequence[str], policy: str | None = None) -> int:
    """Give back the seats of ``trajectory_ids`` that still have no call: rows deleted, groups' counts lowered.

    A trajectory that has a call (another call of it was recorded meanwhile) keeps its seat; with ``policy``,
    so does one of another policy (the id was never the caller's). Returns how many seats were given back.
    """
    if not trajectory_ids:
        return 0
    seats = T.c.id.in_(list(trajectory_ids)) & (T.c.n_calls == 0)
    if policy is not None:
        seats &= T.c.policy == policy
    async with engine.begin() as conn:
        gone = await conn.execute(delete(T).where(seats).returning(T.c.group_id))
        by_group = Counter(str(row[0]) for row in gone)
        for group_id, n in sorted(by_group.items()):  # key order: replicas lock groups in the same order
            await conn.execute(
                update(G).where(G.c.id == group_id).values(seats=case((G.c.seats > n, G.c.seats - n), else_=0))
            )
    return sum(by_group.values())


async def release_stale_seats(engine: AsyncEngine, older_than_s: float) -> int:
    """Give back every seat taken more than ``older_than_s`` ago whose call was never recorded."""
    cutoff = time.time() - older_than_s
    released = 0
    while True:
        async with engine.connect() as conn:
            query = select(T.c.id).where(T.c.n_calls == 0, T.c.created_at < cutoff).order_by(T.c.id).limit(_SWEEP)
            stale = [str(row[0]) for row in (await conn.execute(query)).all()]
        released += await release_seats(engine, stale)
        if len(stale) < _SWEEP:
            return released


_RELEASE = "DELETE FROM trajectories WHERE id = ? AND policy = ? AND n_calls = 0 RETURNING group_id"
_GIVE_BACK = "UPDATE groups SET seats = CASE WHEN seats > 1 THEN seats - 1 ELSE 0 END WHERE id = ?"


def release_seats_sqlite(conn: sqlite3.Connection, seats: Sequence[tuple[str, str]]) -> int:
    """``release_seats`` of (trajectory id, policy) pairs on SQLite's own driver, in one IMMEDIATE transaction
    (the writer's thread)."""
    conn.execute("BEGIN IMMEDIATE")
    released = 0
    try:
        for trajectory_id, policy in seats:
            for (group_id,) in conn.execute(_RELEASE, (trajectory_id, policy)).fetchall():
                conn.execute(_GIVE_BACK, (group_id,))
                released += 1
    except BaseException:
        conn.rollback()
        raise
    conn.commit()
    return released
