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

One call never fails another. Its record is checked and encoded before it is queued
(``store._record_check``); a batch that fails all the same (a row the database refuses) is written
again row by row, so only the bad rows fail, and a failed row's new trajectory gives back its seat in
its derived group (``store._derived.release_seats``): no group waits for a call that was never recorded.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine
from tenacity import Retrying, before_sleep_log, retry_if_exception, stop_after_attempt, wait_exponential

from store._batch import CallWrite, write_batch, write_batch_sqlite
from store._derived import Seat, release_seats, release_seats_sqlite, seat_all_sqlite
from store._errors import KeyTaken, RecordRefused, StoreFull, StoreUnavailable, is_disk_full
from store._full_disk import FULL_DISK
from store._redact import redact

log = logging.getLogger("tracetrain.store")


_MAX_BATCH = 512
_WRITE_ATTEMPTS = 3
_QUEUE = object()  # what _here returns when the item must go the thread's way


_Pending = tuple[CallWrite | Seat, "asyncio.Future[Any] | None"]


def _transient(error: BaseException) -> bool:
    """Worth retrying at once: anything but a full disk, which stays full longer than a retry waits, and an id
    another policy holds, which it holds for good."""
    return not isinstance(error, KeyTaken) and not is_disk_full(error)


def _database_down(error: BaseException) -> bool:
    """The database itself failed (gone, locked, full), not one row: writing the rest row by row is no use."""
    if is_disk_full(error):
        return True
    if isinstance(error, OperationalError | InterfaceError) or getattr(error, "connection_invalidated", False):
        return True
    return isinstance(error, sqlite3.OperationalError | OSError | ConnectionError)


def _write_failed(doing: str, error: BaseException) -> None:
    """A failed write in the log: a full disk once per episode (``store._full_disk``), anything else each time."""
    if is_disk_full(error):
        FULL_DISK.failed(doing, error)
    else:
        log.error("could not write to the store (%s): %s", doing, redact(str(error)))


def _settle_all(settled: list[tuple[asyncio.Future[Any], Any, Exception | None]]) -> None:
    for done, result, error in settled:
        _settle(done, result, error)


def _settle(done: asyncio.Future[Any], result: Any, error: Exception | None) -> None:
    if done.done():
        return
    if error is None:
        done.set_result(result)
    elif isinstance(error, RecordRefused | KeyTaken):
        done.set_exception(error)
    elif is_disk_full(error):
        done.set_exception(StoreFull(f"could not write to the store, its disk is full: {redact(str(error))}"))
    else:
        done.set_exception(StoreUnavailable(f"could not write to the store: {redact(str(error))}"))


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
        self._here_driver: sqlite3.Connection | None = None  # its sqlite3 connection, looked up once
        if sync_engine is not None:
            self._here_conn = sync_engine.raw_connection()
            self._here_conn.cursor().execute("PRAGMA busy_timeout = 0")
            self._here_driver = self._here_conn.driver_connection
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
        if self._here_driver is None or self._busy or not self._pending.empty():
            return _QUEUE
        try:
            result = commit(self._here_driver, [item])
        except sqlite3.Error:  # locked, or worse: the thread's way retries and reports it
            return _QUEUE
        FULL_DISK.succeeded()
        return result

    def record_nowait(self, write: CallWrite) -> None:
        """Queue a call without waiting (its client is gone; nobody waits for the answer)."""
        self._pending.put((write, None))

    async def close(self) -> None:
        self._pending.put(None)
        await asyncio.to_thread(self._thread.join)
        if self._here_conn is not None:
            self._here_conn.close()
            self._here_conn = self._here_driver = None

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

        A batch of several items that fails is written again item by item (``_one_by_one``): one bad
        row must not fail the calls beside it. ``last``: the thread writes nothing more of this batch,
        so it is idle before its callers are told: a caller's next lone call then finds it idle
        (``_here``) instead of racing it.
        """
        items = [item for item, _ in batch]
        outcomes: list[tuple[Any, Exception | None]]
        try:
            for attempt in self._retrying:
                with attempt:
                    results = commit(items)
            outcomes = [(results[i] if results else None, None) for i in range(len(batch))]
            FULL_DISK.succeeded()
        except Exception as exc:
            if len(batch) > 1 and not _database_down(exc):
                log.warning("a batch of %d items failed (%s); writing them one by one", len(batch), redact(str(exc)))
                outcomes = self._one_by_one(commit, items)
            else:
                _write_failed(f"writing {len(batch)} items", exc)
                outcomes = [(None, exc)] * len(batch)
        self._release_failed_seats(items, outcomes)
        if last:
            self._busy = False
        settled = [(done, result, error) for (_, done), (result, error) in zip(batch, outcomes, strict=True)
                   if done is not None]  # fmt: skip
        if settled:  # one wake-up of the event loop for the whole batch, not one per call
            self._loop.call_soon_threadsafe(_settle_all, settled)

    def _one_by_one(
        self, commit: Callable[[list[Any]], list[Any] | None], items: list[Any]
    ) -> list[tuple[Any, Exception | None]]:
        """Each item in a transaction of its own; once the database itself fails, the rest fail with it."""
        outcomes: list[tuple[Any, Exception | None]] = []
        for i, item in enumerate(items):
            try:
                results = commit([item])
            except Exception as exc:
                _write_failed("writing an item", exc)
                if _database_down(exc):
                    return outcomes + [(None, exc)] * (len(items) - i)
                outcomes.append((None, exc))
            else:
                outcomes.append((results[0] if results else None, None))
        return outcomes

    def _release_failed_seats(self, items: list[Any], outcomes: list[tuple[Any, Exception | None]]) -> None:
        """Give back the seats of new trajectories whose first call failed to record (their rows have no call).

        A seat taken in the record's own transaction (``seat_in``) went with it; a trajectory another policy
        holds (``KeyTaken``) was never this record's to give back. Best effort: a seat not given back now (the
        database is down) is given back by the sweep (``release_stale_seats``).
        """
        seated = [
            (item.trajectory_id, item.policy) for item, (_, error) in zip(items, outcomes, strict=True)
            if error is not None and not isinstance(error, KeyTaken) and isinstance(item, CallWrite)
            and not item.seat_in
        ]  # fmt: skip
        if not seated:
            return
        try:
            if self._sync is not None:
                released = release_seats_sqlite(self._sqlite(), seated)
            else:
                released = sum(
                    asyncio.run_coroutine_threadsafe(release_seats(self._engine, [t], policy), self._loop).result()
                    for t, policy in seated
                )
        except Exception as exc:
            if not is_disk_full(exc):  # a full disk is already told (FULL_DISK); the sweep gives them back later
                log.warning("could not give back %d seats now (the sweep will): %s", len(seated), redact(str(exc)))
            return
        if released:
            log.info("gave back %d seats of calls that could not be recorded", released)

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
