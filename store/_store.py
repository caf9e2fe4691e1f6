"""The store: SQLModel tables over SQLite (WAL, aiosqlite) or Postgres (asyncpg).

Captured calls are written by one background writer (a thread on SQLite) that commits in groups: every
call that finished while the previous commit ran is written in the next single
transaction. ``record_call`` returns once its transaction committed, so the proxy can
send a response's last byte only after its record is durable, while a burst of 64
concurrent calls costs a handful of commits, not 64.

SQLite runs in WAL mode with ``synchronous=NORMAL``: a committed record survives a
crash of the proxy process (not necessarily a power cut; set ``synchronous=FULL`` in
``sqlite_pragmas`` for that).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson
from sqlalchemy import Connection, Engine, bindparam, create_engine, event, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry
from sqlmodel import SQLModel

import store._tables  # noqa: F401  (registers the tables)

log = logging.getLogger("tracetrain.store")

# Core tables: the hot path writes with executemany, not one ORM object per row.
T = SQLModel.metadata.tables["trajectories"]
G = SQLModel.metadata.tables["groups"]
C = SQLModel.metadata.tables["calls"]
R = SQLModel.metadata.tables["rewards"]
P = SQLModel.metadata.tables["policies"]
J = SQLModel.metadata.tables["training_jobs"]
A = SQLModel.metadata.tables["adapters"]

SQLITE_PRAGMAS = ("journal_mode=WAL", "synchronous=NORMAL", "busy_timeout=10000", "foreign_keys=OFF")
_MAX_BATCH = 512
_R = TypeVar("_R")
_WRITE_ATTEMPTS = 3


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


_Pending = tuple[CallWrite, "asyncio.Future[None] | None"]


@dataclass(frozen=True, slots=True)
class RewardIn:
    trajectory_id: str
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)
    source: str = "external"
    explanation: str | None = None


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def _on_connect_sqlite(dbapi_connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
    cursor = dbapi_connection.cursor()
    for pragma in SQLITE_PRAGMAS:
        cursor.execute(f"PRAGMA {pragma}")
    cursor.close()


async def connect(url: str) -> AsyncEngine:
    """An async engine on the store (tables created if missing): the proxy's and the trainer's."""
    if url.startswith("sqlite"):
        path = url.split(":///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    engine = create_async_engine(url, json_serializer=_dumps, json_deserializer=orjson.loads)
    if engine.dialect.name == "sqlite":
        event.listen(engine.sync_engine, "connect", _on_connect_sqlite)
    async with engine.begin() as conn:
        await conn.run_sync(SQLModel.metadata.create_all)
    return engine


def _write_batch(conn: Connection, dialect: str, writes: Sequence[CallWrite]) -> None:
    """One transaction's worth of captured calls, with their groups and trajectories."""
    groups: dict[str, dict[str, Any]] = {}
    trajectories: dict[str, dict[str, Any]] = {}
    updates: dict[str, dict[str, Any]] = {}
    for w in writes:
        groups.setdefault(
            w.group_id,
            {
                "id": w.group_id,
                "policy": w.policy,
                "task_key": w.task_key,
                "state": "open",
                "created_at": w.created_at,
            },
        )
        trajectories.setdefault(
            w.trajectory_id,
            {
                "id": w.trajectory_id,
                "group_id": w.group_id,
                "policy": w.policy,
                "keyed_by": w.keyed_by,
                "created_at": w.created_at,
                "updated_at": w.created_at,
                "n_calls": 0,
                "last_version": 0,
                "metrics": {},
            },
        )
        previous = updates.get(w.trajectory_id)
        updates[w.trajectory_id] = {
            "b_id": w.trajectory_id,
            "b_n": (previous["b_n"] if previous else 0) + 1,
            "b_t": time.time(),
            "b_v": w.version,
            "b_tail": w.tail_hash,
        }
    conn.execute(insert_ignore(dialect, G, ["id"]), list(groups.values()))
    conn.execute(insert_ignore(dialect, T, ["id"]), list(trajectories.values()))
    conn.execute(insert(C), [w.call for w in writes])
    conn.execute(
        update(T)
        .where(T.c.id == bindparam("b_id"))
        .values(
            n_calls=T.c.n_calls + bindparam("b_n"),
            updated_at=bindparam("b_t"),
            last_version=bindparam("b_v"),
            tail_hash=bindparam("b_tail"),
        ),
        list(updates.values()),
    )


def insert_ignore(dialect: str, table: Any, keys: list[str]) -> Any:
    """INSERT ... ON CONFLICT DO NOTHING in the store's dialect."""
    module = postgresql if dialect == "postgresql" else sqlite
    return module.insert(table).on_conflict_do_nothing(index_elements=keys)


def _settle(done: asyncio.Future[None], error: Exception | None) -> None:
    from proxy.errors import StoreUnavailable  # imported late: proxy imports the store

    if done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(StoreUnavailable(f"could not record the call: {error}"))


class Store:
    """Access to the tables; one instance per process, built in the app's lifespan.

    The group-commit writer is a thread. On SQLite it commits through its own connection,
    and the few lookups on the request path read synchronously (an indexed SQLite read
    takes tens of microseconds; a hop to aiosqlite's thread and back costs ten times that).
    On Postgres the writer hands each commit to the async engine on the event loop, and
    reads go through it too. ``engine`` (async) serves everything else.
    """

    def __init__(self, engine: AsyncEngine, sync_engine: Engine | None = None) -> None:
        self.engine = engine
        self._dialect = engine.dialect.name
        self._sync = sync_engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None

    @classmethod
    async def open(cls, url: str) -> Store:
        """Connect, create missing tables and start the group-commit writer."""
        engine = await connect(url)
        sync_engine = None
        if engine.dialect.name == "sqlite":
            sync_engine = create_engine(
                engine.url.set(drivername="sqlite"),
                json_serializer=_dumps,
                json_deserializer=orjson.loads,
                connect_args={"check_same_thread": False},
            )
            event.listen(sync_engine, "connect", _on_connect_sqlite)
        store = cls(engine, sync_engine)
        store._loop = asyncio.get_running_loop()
        store._writer = threading.Thread(target=store._write_thread, name="tracetrain-store-writer", daemon=True)
        store._writer.start()
        return store

    async def close(self) -> None:
        """Write everything still queued, then release the connections."""
        self._pending.put(None)
        if self._writer is not None:
            await asyncio.to_thread(self._writer.join)
            self._writer = None
        if self._sync is not None:
            self._sync.dispose()
        await self.engine.dispose()

    # -- captured calls ---------------------------------------------------------------

    async def record_call(self, write: CallWrite) -> None:
        """Queue a call and return once the transaction holding it committed."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.put((write, done))
        await done

    def record_call_nowait(self, write: CallWrite) -> None:
        """Queue a call without waiting (its client is gone; nobody waits for the answer)."""
        self._pending.put((write, None))

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

    def _write_thread(self) -> None:
        """Commit whatever is queued, in groups, until close(); retry, then fail the callers."""
        assert self._loop is not None
        commit = self._commit_sqlite if self._sync is not None else self._commit_on_loop
        closing = False
        while not closing:
            first = self._pending.get()
            if first is None:
                return
            batch, closing = self._next_batch(first)
            error: Exception | None = None
            for attempt in range(_WRITE_ATTEMPTS):
                try:
                    commit([write for write, _ in batch])
                    error = None
                    break
                except Exception as exc:  # the database is down or locked
                    error = exc
                    log.warning("writing %d calls failed (attempt %d): %s", len(batch), attempt + 1, exc)
                    time.sleep(0.05 * 2**attempt)
            for _, done in batch:
                if done is not None:
                    self._loop.call_soon_threadsafe(_settle, done, error)

    def _commit_sqlite(self, writes: list[CallWrite]) -> None:
        assert self._sync is not None
        with self._sync.begin() as conn:
            _write_batch(conn, self._dialect, writes)

    def _commit_on_loop(self, writes: list[CallWrite]) -> None:
        """Postgres: the async engine belongs to the event loop, so the commit runs there."""

        async def commit() -> None:
            async with self.engine.begin() as conn:
                await conn.run_sync(_write_batch, self._dialect, writes)

        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(commit(), self._loop).result()

    async def _read(self, query: Callable[[Connection], _R]) -> _R:
        """A short read: synchronous on SQLite, through the async engine elsewhere."""
        if self._sync is not None:
            with self._sync.connect() as conn:
                return query(conn)
        async with self.engine.connect() as conn:
            return await conn.run_sync(query)

    # -- lookups for keying -------------------------------------------------------------

    async def trajectory_group(self, trajectory_id: str) -> tuple[str, str] | None:
        """(group_id, policy) of a stored trajectory, or None."""

        def query(conn: Connection) -> tuple[str, str] | None:
            row = conn.execute(select(T.c.group_id, T.c.policy).where(T.c.id == trajectory_id)).first()
            return (row[0], row[1]) if row else None

        return await self._read(query)

    async def find_open_thread(self, tail_hashes: Sequence[str], since: float) -> tuple[str, str, str] | None:
        """The unkeyed trajectory whose last request plus reply hashes to one of ``tail_hashes``.

        Earlier hashes in the sequence win (callers pass the longest prefix first).
        Returns (trajectory_id, group_id, tail_hash).
        """
        if not tail_hashes:
            return None

        def query(conn: Connection) -> list[Any]:
            found = select(T.c.id, T.c.group_id, T.c.tail_hash).where(
                T.c.tail_hash.in_(list(tail_hashes)), T.c.updated_at >= since, T.c.reward.is_(None)
            )
            return list(conn.execute(found).all())

        by_hash = {row[2]: (row[0], row[1], row[2]) for row in await self._read(query)}
        return next((by_hash[h] for h in tail_hashes if h in by_hash), None)

    async def open_group_for_task(self, policy: str, task_key: str) -> tuple[str, int] | None:
        """The newest open group derived from ``task_key`` and how many trajectories it has."""

        def query(conn: Connection) -> tuple[str, int] | None:
            row = conn.execute(
                select(G.c.id)
                .where(G.c.policy == policy, G.c.task_key == task_key, G.c.state == "open")
                .order_by(G.c.created_at.desc())
                .limit(1)
            ).first()
            if row is None:
                return None
            size = conn.execute(select(func.count()).where(T.c.group_id == row[0])).scalar_one()
            return str(row[0]), int(size)

        return await self._read(query)

    # -- policies ---------------------------------------------------------------------------

    async def ensure_policy(self, name: str, base_model: str) -> int:
        """Create the policy row if missing; return its active version."""
        now = time.time()
        async with self.engine.begin() as conn:
            await conn.execute(
                insert_ignore(self._dialect, P, ["name"]),
                [{"name": name, "base_model": base_model, "active_version": 0, "created_at": now, "updated_at": now}],
            )
            row = (await conn.execute(select(P.c.active_version).where(P.c.name == name))).one()
        return int(row[0])

    # -- rewards ----------------------------------------------------------------------------

    async def add_rewards(self, rewards: Iterable[RewardIn]) -> list[dict[str, Any]]:
        """Record rewards in one transaction; any unknown trajectory id rejects the whole batch."""
        items = list(rewards)
        wanted = {r.trajectory_id for r in items}
        now = time.time()
        async with self.engine.begin() as conn:
            rows = (await conn.execute(select(T.c.id, T.c.group_id).where(T.c.id.in_(wanted)))).all()
            group_of = {row[0]: row[1] for row in rows}
            missing = sorted(wanted - group_of.keys())
            if missing:
                from proxy.errors import TrajectoryNotFound  # imported late: proxy imports the store

                shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                raise TrajectoryNotFound(
                    f"no trajectory with id {shown}; nothing was recorded. Rewards name the X-Trajectory-Id "
                    "the proxy returned with the agent's calls.",
                    param="trajectory_id",
                )
            created = [
                {
                    "trajectory_id": r.trajectory_id,
                    "group_id": group_of[r.trajectory_id],
                    "value": r.reward,
                    "metrics": r.metrics,
                    "source": r.source,
                    "explanation": r.explanation,
                    "created_at": now,
                }
                for r in items
            ]
            await conn.execute(insert(R), created)
            external = [r for r in items if r.source == "external"]
            if external:
                await conn.execute(
                    update(T)
                    .where(T.c.id == bindparam("b_id"))
                    .values(
                        reward=bindparam("b_r"),
                        reward_source="external",
                        metrics=bindparam("b_m"),
                        rewarded_at=now,
                        tail_hash=None,
                    ),
                    [{"b_id": r.trajectory_id, "b_r": r.reward, "b_m": r.metrics} for r in external],
                )
        return created
