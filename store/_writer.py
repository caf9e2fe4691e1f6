"""The group-commit writer: every captured call, durable before its response's last byte.

One background thread commits in groups: every call that finished while the previous
commit ran is written in the next single transaction. ``record`` returns once its
transaction committed, so the proxy sends a response's last byte only after its record
is durable, while a burst of 64 concurrent calls costs a handful of commits, not 64.

On SQLite the thread commits through its own connection; on Postgres it hands each
commit to the async engine on the event loop. On SQLite it also seats new trajectories in
their derived groups (``seat``, ``store._derived.seat_all_sqlite``): the seats asked while a
commit ran share the next transaction, committed before that batch's calls.

A lone call gains nothing from grouping, and a trip to the thread and back costs it more
than its commit (waking the thread, and the thread and the event loop taking turns at the
GIL: 0.3-1.1 ms against ~0.1 ms for the statements, docs/BENCHMARKS.md). So on SQLite a
caller that says its call is the only one in flight (``alone``) has it committed on its own
thread, through a connection that never waits for SQLite's lock, when the writer is idle;
if the lock is taken (the writer, or another process) it goes the thread's way after all.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import JSON, Connection, Engine, Executable, bindparam, insert, update
from sqlalchemy.ext.asyncio import AsyncEngine
from tenacity import Retrying, before_sleep_log, retry_if_exception, stop_after_attempt, wait_exponential

from store._derived import Seat, seat_all_sqlite, seat_one_sqlite
from store._engine import dumps, insert_ignore
from store._errors import StoreFull, StoreUnavailable, is_disk_full
from store._lifecycle import GroupState
from store._tables import calls as C
from store._tables import groups as G
from store._tables import trajectories as T

log = logging.getLogger("tracetrain.store")


_MAX_BATCH = 512
_WRITE_ATTEMPTS = 3
_QUEUE = object()  # what _here returns when the item must go the thread's way


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


_Pending = tuple[CallWrite | Seat, "asyncio.Future[Any] | None"]


@functools.cache
def _statements(dialect: str) -> tuple[Executable, Executable, Executable, Executable]:
    """The batch's four statements, built once: SQLAlchemy then finds their compiled form by a memoized key."""
    return (
        insert_ignore(dialect, G, ["id"]),
        insert_ignore(dialect, T, ["id"]),
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
        groups.setdefault(
            w.group_id,
            {"id": w.group_id, "policy": w.policy, "task_key": w.task_key, "state": GroupState.OPEN.value,
             "created_at": w.created_at},
        )  # fmt: skip
        trajectories.setdefault(
            w.trajectory_id,
            {"id": w.trajectory_id, "group_id": w.group_id, "policy": w.policy, "keyed_by": w.keyed_by,
             "created_at": w.created_at, "updated_at": w.created_at, "n_calls": 0, "last_version": 0, "metrics": {}},
        )  # fmt: skip
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
    insert_groups, insert_trajectories, insert_calls, update_trajectories = _statements(dialect)
    conn.execute(insert_groups, groups)
    conn.execute(insert_trajectories, trajectories)
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
        for w in writes:
            if w.seat_in:
                seat = Seat(w.policy, str(w.task_key), w.trajectory_id, w.keyed_by, w.seat_in, w.created_at)
                w.group_id = w.call["group_id"] = seat_one_sqlite(conn, seat)
        groups, trajectories, updates = _rows(writes)
        _insert_sqlite(conn, G.name, groups, ignore=True)
        _insert_sqlite(conn, T.name, trajectories, ignore=True)
        _insert_sqlite(conn, C.name, [w.call for w in writes], ignore=False)
        conn.executemany(_UPDATE_TRAJECTORY, updates)
    except BaseException:
        conn.rollback()
        raise
    conn.commit()


def _by_id(row: Mapping[str, Any]) -> str:
    return str(row["id"])


def _transient(error: BaseException) -> bool:
    """Worth retrying at once: anything but a full disk, which stays full longer than a retry waits."""
    return not is_disk_full(error)


def _settle(done: asyncio.Future[Any], result: Any, error: Exception | None) -> None:
    if done.done():
        return
    if error is None:
        done.set_result(result)
    elif is_disk_full(error):
        done.set_exception(StoreFull(f"could not write to the store, its disk is full: {error}"))
    else:
        done.set_exception(StoreUnavailable(f"could not write to the store: {error}"))


class GroupCommitWriter:
    """The thread that commits queued calls in groups; ``close`` writes what is queued first."""

    def __init__(self, engine: AsyncEngine, sync_engine: Engine | None, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self._sync = sync_engine
        self._dialect = engine.dialect.name
        self._loop = loop
        self._pending: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        # The database may be briefly down or locked: retry, then fail the callers.
        self._retrying = Retrying(
            retry=retry_if_exception(_transient),
            stop=stop_after_attempt(_WRITE_ATTEMPTS),
            wait=wait_exponential(multiplier=0.05),
            before_sleep=before_sleep_log(log, logging.WARNING),
            reraise=True,
        )
        self._raw: Any = None  # SQLite: the thread's own connection, held while it runs
        self._busy = False  # the thread is writing a batch
        # SQLite: the caller's connection for lone writes; it gives up at once when the lock is taken.
        self._here_conn: Any = None
        if sync_engine is not None:
            self._here_conn = sync_engine.raw_connection()
            self._here_conn.cursor().execute("PRAGMA busy_timeout = 0")
        self._thread = threading.Thread(target=self._run, name="tracetrain-store-writer", daemon=True)
        self._thread.start()

    async def record(self, write: CallWrite, *, alone: bool = False) -> None:
        """Return once the transaction holding the call committed (``alone``: see the module docstring)."""
        if alone and self._here(write_batch_sqlite, write) is not _QUEUE:
            return
        done: asyncio.Future[None] = self._loop.create_future()
        self._pending.put((write, done))
        await done

    async def seat(self, seat: Seat, *, alone: bool = False) -> str:
        """The derived group of a new trajectory (SQLite only), seated like ``record`` commits."""
        assert self._sync is not None, "seats go through the writer on SQLite only"
        if alone:
            seated = self._here(seat_all_sqlite, seat)
            if seated is not _QUEUE:
                return str(seated[0])
        done: asyncio.Future[str] = self._loop.create_future()
        self._pending.put((seat, done))
        return await done

    def _here(self, commit: Callable[[sqlite3.Connection, list[Any]], Any], item: CallWrite | Seat) -> Any:
        """``commit`` one item on the caller's thread if the writer is idle and SQLite's lock free, else _QUEUE."""
        if self._here_conn is None or self._busy or not self._pending.empty():
            return _QUEUE
        try:
            return commit(self._here_conn.driver_connection, [item])
        except sqlite3.Error:  # locked, or worse: the thread's way retries and reports it
            return _QUEUE

    def record_nowait(self, write: CallWrite) -> None:
        """Queue a call without waiting (its client is gone; nobody waits for the answer)."""
        self._pending.put((write, None))

    async def close(self) -> None:
        self._pending.put(None)
        await asyncio.to_thread(self._thread.join)
        if self._here_conn is not None:
            self._here_conn.close()
            self._here_conn = None

    def _next_batch(self, first: _Pending) -> tuple[list[_Pending], bool]:
        """``first`` and whatever else is queued, up to a limit; True once close() was asked."""
        batch = [first]
        while len(batch) < _MAX_BATCH:
            try:
                item = self._pending.get_nowait()
            except queue.Empty:
                return batch, False
            if item is None:
                return batch, True
            batch.append(item)
        return batch, False

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            if self._raw is not None:
                self._raw.close()

    def _serve(self) -> None:
        closing = False
        while not closing:
            first = self._pending.get()
            if first is None:
                return
            self._busy = True
            try:
                batch, closing = self._next_batch(first)
                seats = [item for item in batch if isinstance(item[0], Seat)]
                calls = [item for item in batch if isinstance(item[0], CallWrite)]
                if seats:  # first: their callers wait to send upstream, the calls' callers only to answer
                    self._write(self._seat_sqlite, seats, last=not calls)
                if calls:
                    commit = self._commit_sqlite if self._sync is not None else self._commit_on_loop
                    self._write(commit, calls, last=True)
            finally:
                self._busy = False

    def _write(self, commit: Callable[[list[Any]], list[Any] | None], batch: list[_Pending], *, last: bool) -> None:
        """``commit`` the batch's items, retried if the database is briefly down or locked; then answer.

        ``last``: the thread writes nothing more of this batch, so it is idle before its callers are told:
        a caller's next lone call then finds it idle (``_here``) instead of racing it.
        """
        results: list[Any] | None = None
        error: Exception | None = None
        try:
            for attempt in self._retrying:
                with attempt:
                    results = commit([item for item, _ in batch])
        except Exception as exc:
            log.error("could not write %d items to the store: %s", len(batch), exc)
            error = exc
        if last:
            self._busy = False
        for i, (_, done) in enumerate(batch):
            if done is not None:
                self._loop.call_soon_threadsafe(_settle, done, results[i] if results else None, error)

    def _sqlite(self) -> sqlite3.Connection:
        assert self._sync is not None
        if self._raw is None:
            self._raw = self._sync.raw_connection()
        driver = self._raw.driver_connection
        assert isinstance(driver, sqlite3.Connection)
        return driver

    def _seat_sqlite(self, seats: list[Seat]) -> list[str]:
        return seat_all_sqlite(self._sqlite(), seats)

    def _commit_sqlite(self, writes: list[CallWrite]) -> None:
        write_batch_sqlite(self._sqlite(), writes)

    def _commit_on_loop(self, writes: list[CallWrite]) -> None:
        """Postgres: the async engine belongs to the event loop, so the commit runs there."""

        async def commit() -> None:
            async with self._engine.begin() as conn:
                await conn.run_sync(write_batch, self._dialect, writes)

        asyncio.run_coroutine_threadsafe(commit(), self._loop).result()
