"""The store: SQLModel tables over SQLite (WAL, aiosqlite) or Postgres (asyncpg).

Captured calls are written by one background task that commits in groups: every
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
import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import bindparam, event, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry
from sqlmodel import SQLModel

import proxy.schema  # noqa: F401  (registers the tables)
from proxy.errors import StoreUnavailable, TrajectoryNotFound

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


class Store:
    """Async access to the tables; one instance per process, built in the app's lifespan."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._dialect = engine.dialect.name
        self._queue: asyncio.Queue[tuple[CallWrite, asyncio.Future[None] | None]] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, url: str) -> Store:
        """Connect, create missing tables and start the group-commit writer."""
        store = cls(await connect(url))
        store._writer = asyncio.create_task(store._write_loop(), name="tracetrain-store-writer")
        return store

    async def close(self) -> None:
        """Write everything still queued, then release the connections."""
        if self._writer is not None:
            await self._queue.join()
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
            self._writer = None
        await self.engine.dispose()

    # -- captured calls ---------------------------------------------------------------

    async def record_call(self, write: CallWrite) -> None:
        """Queue a call and return once the transaction holding it committed."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((write, done))
        await done

    def record_call_nowait(self, write: CallWrite) -> None:
        """Queue a call without waiting (its client is gone; nobody waits for the answer)."""
        self._queue.put_nowait((write, None))

    async def _write_loop(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < _MAX_BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            error: BaseException | None = None
            for attempt in range(_WRITE_ATTEMPTS):
                try:
                    async with self.engine.begin() as conn:
                        await self._write_batch(conn, [write for write, _ in batch])
                    error = None
                    break
                except Exception as exc:  # the database is down or locked: retry, then fail the callers
                    error = exc
                    log.warning("writing %d calls failed (attempt %d): %s", len(batch), attempt + 1, exc)
                    await asyncio.sleep(0.05 * 2**attempt)
            for _, done in batch:
                if done is not None and not done.done():
                    if error is None:
                        done.set_result(None)
                    else:
                        done.set_exception(StoreUnavailable(f"could not record the call: {error}"))
                self._queue.task_done()

    async def _write_batch(self, conn: AsyncConnection, writes: Sequence[CallWrite]) -> None:
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
        await conn.execute(self._insert_ignore(G, ["id"]), list(groups.values()))
        await conn.execute(self._insert_ignore(T, ["id"]), list(trajectories.values()))
        await conn.execute(insert(C), [w.call for w in writes])
        await conn.execute(
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

    def _insert_ignore(self, table: Any, keys: list[str]) -> Any:
        dialect = postgresql if self._dialect == "postgresql" else sqlite
        return dialect.insert(table).on_conflict_do_nothing(index_elements=keys)

    # -- lookups for keying -------------------------------------------------------------

    async def trajectory_group(self, trajectory_id: str) -> tuple[str, str] | None:
        """(group_id, policy) of a stored trajectory, or None."""
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(T.c.group_id, T.c.policy).where(T.c.id == trajectory_id))).first()
        return (row[0], row[1]) if row else None

    async def find_open_thread(self, tail_hashes: Sequence[str], since: float) -> tuple[str, str, str] | None:
        """The unkeyed trajectory whose last request plus reply hashes to one of ``tail_hashes``.

        Earlier hashes in the sequence win (callers pass the longest prefix first).
        Returns (trajectory_id, group_id, tail_hash).
        """
        if not tail_hashes:
            return None
        async with self.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(T.c.id, T.c.group_id, T.c.tail_hash).where(
                        T.c.tail_hash.in_(list(tail_hashes)), T.c.updated_at >= since, T.c.reward.is_(None)
                    )
                )
            ).all()
        by_hash = {row[2]: (row[0], row[1], row[2]) for row in rows}
        return next((by_hash[h] for h in tail_hashes if h in by_hash), None)

    async def open_group_for_task(self, policy: str, task_key: str) -> tuple[str, int] | None:
        """The newest open group derived from ``task_key`` and how many trajectories it has."""
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(G.c.id)
                    .where(G.c.policy == policy, G.c.task_key == task_key, G.c.state == "open")
                    .order_by(G.c.created_at.desc())
                    .limit(1)
                )
            ).first()
            if row is None:
                return None
            size = (await conn.execute(select(func.count()).where(T.c.group_id == row[0]))).scalar_one()
        return row[0], int(size)

    # -- policies ---------------------------------------------------------------------------

    async def ensure_policy(self, name: str, base_model: str) -> int:
        """Create the policy row if missing; return its active version."""
        now = time.time()
        async with self.engine.begin() as conn:
            await conn.execute(
                self._insert_ignore(P, ["name"]),
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
