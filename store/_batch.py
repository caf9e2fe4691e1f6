"""One batch of captured calls: the rows it writes and its statements, through SQLAlchemy or SQLite's own driver.

The group-commit writer (``store._writer``) commits each batch in one transaction: the new groups,
the new trajectories, the calls, and the trajectories' counts, in key order. On SQLite the same
statements run as plain SQL on the driver's connection, with the seats the batch's records
take (``CallWrite.seat_in``) first: a seated trajectory's row is written there with its first call's
values, and the batch's other statements leave it alone (unless another record of it is in the batch).

A group or trajectory row that already exists is kept as it is (``ON CONFLICT DO NOTHING``), so the
batch then reads the owners of its groups and trajectories: a record whose group or trajectory another
policy holds is ``KeyTaken`` (the writer then writes the batch row by row, and that record alone fails).
Keying refuses such a call before it is sent (``proxy.gateway._keying``); this is the store's own guard.
"""

from __future__ import annotations

import functools
import itertools
import sqlite3
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import JSON, Connection, Executable, bindparam, insert, literal_column, select, union_all, update

from store._derived import FirstCall, Seat, seat_one_sqlite
from store._engine import dumps, insert_ignore
from store._errors import KeyTaken
from store._lifecycle import GroupState
from store._tables import calls as C
from store._tables import groups as G
from store._tables import trajectories as T

_OPEN = GroupState.OPEN.value  # once: an enum member's value is a Python-level descriptor, per row otherwise


@dataclass(slots=True)
class CallWrite:
    """One captured call plus what its trajectory and group rows need."""

    call: dict[str, Any]  # column -> value for the calls table
    trajectory_id: str
    group_id: str
    policy: str
    keyed_by: str
    task_key: str | None
    tail_hash: str | None
    created_at: float
    version: int
    # > 0: a new trajectory whose seat in its task's derived group (of this size) is taken in the
    # record's own transaction (SQLite), one commit instead of two; ``group_id`` is filled in then.
    seat_in: int = 0


@functools.cache
def _statements(dialect: str) -> tuple[Executable, Executable, Executable, Executable, Executable]:
    """The batch's statements, built once: SQLAlchemy then finds their compiled form by a memoized key."""
    return (
        insert_ignore(dialect, G, ["id"]),
        insert_ignore(dialect, T, ["id"]),
        union_all(
            select(literal_column("'group'"), G.c.id, G.c.policy).where(G.c.id.in_(bindparam("g", expanding=True))),
            select(literal_column("'trajectory'"), T.c.id, T.c.policy).where(
                T.c.id.in_(bindparam("t", expanding=True))
            ),
        ),
        insert(C),
        update(T)
        .where(T.c.id == bindparam("b_id"))
        .values(
            n_calls=T.c.n_calls + bindparam("b_n"),
            updated_at=bindparam("b_t"),
            last_version=bindparam("b_v"),
            tail_hash=bindparam("b_tail"),
        ),
    )


def _rows(writes: Sequence[CallWrite]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """The batch's new groups, new trajectories and trajectory updates, each in key order.

    Rows in key order: two replicas' batches touching the same rows lock them in the same
    order, so Postgres never finds them waiting on each other (a deadlock, one batch aborted).
    """
    groups: dict[str, dict[str, Any]] = {}
    trajectories: dict[str, dict[str, Any]] = {}
    updates: dict[str, dict[str, Any]] = {}
    for w in writes:
        group = groups.setdefault(
            w.group_id,
            {"id": w.group_id, "policy": w.policy, "task_key": w.task_key, "state": _OPEN,
             "created_at": w.created_at},
        )  # fmt: skip
        trajectory = trajectories.setdefault(
            w.trajectory_id,
            {"id": w.trajectory_id, "group_id": w.group_id, "policy": w.policy, "keyed_by": w.keyed_by,
             "created_at": w.created_at, "updated_at": w.created_at, "n_calls": 0, "last_version": 0, "metrics": {}},
        )  # fmt: skip
        if group["policy"] != w.policy:  # two policies' records of one id in one batch: row by row, the later fails
            raise KeyTaken("group", w.group_id)
        if trajectory["policy"] != w.policy:
            raise KeyTaken("trajectory", w.trajectory_id)
        previous = updates.get(w.trajectory_id)
        updates[w.trajectory_id] = {
            "b_id": w.trajectory_id,
            "b_n": (previous["b_n"] if previous else 0) + 1,
            "b_t": time.time(),
            "b_v": w.version,
            "b_tail": w.tail_hash,
        }
    return (
        sorted(groups.values(), key=_by_id),
        sorted(trajectories.values(), key=_by_id),
        [updates[key] for key in sorted(updates)],
    )


def write_batch(conn: Connection, dialect: str, writes: Sequence[CallWrite]) -> None:
    """One transaction's worth of captured calls, with their groups and trajectories (through SQLAlchemy)."""
    if any(w.seat_in for w in writes):
        raise ValueError("a seat is taken with its record on SQLite only (Store.seats_with_records)")
    groups, trajectories, updates = _rows(writes)
    insert_groups, insert_trajectories, owners, insert_calls, update_trajectories = _statements(dialect)
    conn.execute(insert_groups, groups)
    conn.execute(insert_trajectories, trajectories)
    _check_owners(conn.execute(owners, {"g": _ids(groups), "t": _ids(trajectories)}), groups, trajectories)
    conn.execute(insert_calls, [w.call for w in writes])
    conn.execute(update_trajectories, updates)


# SQLite's own driver: the same four statements as plain SQL. SQLAlchemy's checkout, compiled-cache
# lookup and parameter processing cost three times the statements themselves for a batch of one.
_JSON = {table.name: frozenset(c.name for c in table.columns if isinstance(c.type, JSON)) for table in (G, T, C)}
# Column defaults SQLAlchemy fills in for a key a row leaves out (all scalars here).
_DEFAULTS = {
    table.name: {c.name: getattr(c.default, "arg", None) for c in table.columns if c.default is not None}
    for table in (G, T, C)
}
_UPDATE_TRAJECTORY = (
    "UPDATE trajectories SET n_calls = n_calls + :b_n, updated_at = :b_t, last_version = :b_v, tail_hash = :b_tail"
    " WHERE id = :b_id"
)


@functools.cache
def _sqlite_insert(table: str, columns: tuple[str, ...], ignore_existing: bool) -> str:
    names, marks = ", ".join(columns), ", ".join("?" * len(columns))
    return f"INSERT INTO {table} ({names}) VALUES ({marks})" + (
        " ON CONFLICT (id) DO NOTHING" if ignore_existing else ""
    )


def _columns(row: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(row)


def _insert_sqlite(conn: sqlite3.Connection, table: str, rows: Sequence[Mapping[str, Any]], ignore: bool) -> None:
    """Insert ``rows`` in order as SQLAlchemy would: JSON encoded (None as ``null``), defaults for left-out keys."""
    json_columns = _JSON[table]
    columns: tuple[str, ...]
    for columns, same in itertools.groupby(rows, key=_columns):
        left_out = {name: value for name, value in _DEFAULTS[table].items() if name not in columns}
        encoders = [dumps if name in json_columns else None for name in columns]
        values = [
            (*(v if encode is None else encode(v) for v, encode in zip(row.values(), encoders, strict=True)),
             *left_out.values())
            for row in same
        ]  # fmt: skip
        conn.executemany(_sqlite_insert(table, (*columns, *left_out), ignore), values)


def write_batch_sqlite(conn: sqlite3.Connection, writes: Sequence[CallWrite]) -> None:
    """``write_batch`` on SQLite's own driver, in one IMMEDIATE transaction, seats first (``seat_in``)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        groups, trajectories, updates = _rows(_seat(conn, writes))
        _insert_sqlite(conn, G.name, groups, ignore=True)
        _insert_sqlite(conn, T.name, trajectories, ignore=True)
        if groups:
            _check_owners(conn.execute(_sqlite_owners(len(groups), len(trajectories)),
                                       (*_ids(groups), *_ids(trajectories))), groups, trajectories)  # fmt: skip
        _insert_sqlite(conn, C.name, [w.call for w in writes], ignore=False)
        conn.executemany(_UPDATE_TRAJECTORY, updates)
    except BaseException:
        conn.rollback()
        raise
    conn.commit()


def _seat(conn: sqlite3.Connection, writes: Sequence[CallWrite]) -> list[CallWrite]:
    """Take the seats of ``writes`` (``seat_in``) in order; the writes whose group and trajectory rows are still
    to be written or updated: all but the seated ones whose row the seat wrote with its call (``FirstCall``)."""
    if not any(w.seat_in for w in writes):
        return list(writes)
    records = Counter(w.trajectory_id for w in writes)
    rest = []
    for w in writes:
        if not w.seat_in:
            rest.append(w)
            continue
        seat = Seat(w.policy, str(w.task_key), w.trajectory_id, w.keyed_by, w.seat_in, w.created_at)
        first = FirstCall(time.time(), w.version, w.tail_hash) if records[w.trajectory_id] == 1 else None
        w.group_id, written = seat_one_sqlite(conn, seat, first)
        w.call["group_id"] = w.group_id
        if first is None or not written:
            rest.append(w)
    return rest


def _by_id(row: Mapping[str, Any]) -> str:
    return str(row["id"])


def _ids(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    return [str(row["id"]) for row in rows]


@functools.lru_cache(maxsize=64)
def _sqlite_owners(n_groups: int, n_trajectories: int) -> str:
    return (
        f"SELECT 'group', id, policy FROM groups WHERE id IN ({', '.join('?' * n_groups)}) UNION ALL "
        f"SELECT 'trajectory', id, policy FROM trajectories WHERE id IN ({', '.join('?' * n_trajectories)})"
    )


def _check_owners(
    stored: Iterable[Sequence[Any]], groups: Sequence[Mapping[str, Any]], trajectories: Sequence[Mapping[str, Any]]
) -> None:
    """``KeyTaken`` for a group or trajectory of the batch whose stored row (``stored``: kind, id, policy) is
    another policy's than its records'."""
    wanted = {("group", row["id"]): row["policy"] for row in groups}
    wanted.update({("trajectory", row["id"]): row["policy"] for row in trajectories})
    for kind, key, policy in stored:
        if wanted.get((kind, key), policy) != policy:
            raise KeyTaken("group" if kind == "group" else "trajectory", str(key))
