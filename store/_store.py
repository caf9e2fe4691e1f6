"""``Store``: one per process, the way in to every table.

``Store.open(url)`` connects (bringing the schema to the current revision), starts the
group-commit writer when the process captures calls, and gathers the store's parts:
``policies``, ``adapters``, ``adapter_files``, ``jobs``, ``judgements``, ``reads``, ``export``, ``guards``,
``reward_timeouts``, ``evaluations``, ``trials``. The few
lookups on the proxy's request path (keying) are methods here. On SQLite the two asked on
every call (a trajectory's group, an open thread) read synchronously through one raw
``sqlite3`` connection held for the store's life: an indexed SQLite read takes tens of
microseconds, a hop to aiosqlite's thread and back ten times that, and SQLAlchemy's
connection checkout and parameter processing around it were 18% of the proxy's time under
load (docs/BENCHMARKS.md). Each statement is stepped to its end, so no read pins a snapshot.
The one write on that path, a new trajectory's seat in its derived group, goes through the
group-commit writer's thread on SQLite (``store._derived``), or, for the only call in flight,
is committed on the event loop's thread (``store._writer``).
Nothing of the store is cached in the process: every replica keys from what the store holds. The
one thing held in memory is the last call each recent trajectory recorded here (``chains``): what
its next call is stored against (``store._compact``); a call it does not know is stored whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, bindparam, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from store._adapter_files import AdapterFiles
from store._adapters import Adapters
from store._batch import CallWrite
from store._compact import Chains
from store._derived import Seat, claim_named, join_task_group, release_seats, release_stale_seats
from store._engine import connect, sqlite_sync_engine
from store._errors import RecordRefused, StoreFull, StoreUnavailable, database_errors
from store._evaluations import Evaluations
from store._export import ExportReads
from store._guard import Guards
from store._jobs import Jobs
from store._judgements import Judgements
from store._policies import Policies
from store._reads import Reads
from store._record_check import checked_call
from store._retention import PruneReport, PruneRule, prune_trajectories, vacuum
from store._rewards import RewardIn, RewardRecord, add_rewards
from store._sessions import Sessions
from store._tables import adapters as A
from store._tables import groups as G
from store._tables import policies as P
from store._tables import trajectories as T
from store._timeouts import RewardTimeouts
from store._trials import Trials
from store._usage import store_bytes
from store._writer import GroupCommitWriter

_R = TypeVar("_R")
log = logging.getLogger("tracetrain.store")

# Built once: SQLAlchemy then finds their compiled form by a memoized cache key (Postgres).
_TRAJECTORY_GROUP = select(T.c.group_id, T.c.policy, T.c.last_version, T.c.n_calls).where(T.c.id == bindparam("id"))
_OPEN_THREADS = select(T.c.id, T.c.group_id, T.c.tail_hash, T.c.last_version).where(
    T.c.tail_hash.in_(bindparam("tails", expanding=True)), T.c.updated_at >= bindparam("since"), T.c.reward.is_(None)
)
# The same two on SQLite's own driver (the hot path).
_SQLITE_TRAJECTORY_GROUP = "SELECT group_id, policy, last_version, n_calls FROM trajectories WHERE id = ?"
_GROUP_POLICY = select(G.c.policy).where(G.c.id == bindparam("id"))
_SQLITE_GROUP_POLICY = "SELECT policy FROM groups WHERE id = ?"
# What the publisher acts on, in brief (``publishing_state``): every policy's adapters by state, and its row.
_ADAPTER_STATES = (
    select(A.c.policy, A.c.state, func.count(), func.max(A.c.version))
    .group_by(A.c.policy, A.c.state)
    .order_by(A.c.policy, A.c.state)
)
_POLICY_STATE = select(P.c.name, P.c.state, P.c.active_version, P.c.training, P.c.rolled_back_at,
                       P.c.updated_at).order_by(P.c.name)  # fmt: skip
_SQLITE_ADAPTER_STATES = (
    "SELECT policy, state, count(*), max(version) FROM adapters GROUP BY policy, state ORDER BY policy, state"
)
_SQLITE_POLICY_STATE = (
    "SELECT name, state, active_version, training, rolled_back_at, updated_at FROM policies ORDER BY name"
)
_SQLITE_OPEN_THREADS = (
    "SELECT id, group_id, tail_hash, last_version FROM trajectories "
    "WHERE tail_hash IN ({}) AND updated_at >= ? AND reward IS NULL"
)


class Store:
    def __init__(self, engine: AsyncEngine, sync_engine: Engine | None = None) -> None:
        self.engine = engine
        self._sync = sync_engine
        # The event loop's own SQLite connection for the keying reads (the writer thread has its own).
        self._held = sync_engine.raw_connection() if sync_engine is not None else None
        self._reader: sqlite3.Connection | None = self._held.driver_connection if self._held is not None else None
        self._writer: GroupCommitWriter | None = None
        # The last recorded call of recent trajectories: new calls of theirs are stored compactly (store._compact).
        self.chains = Chains()
        self.policies = Policies(engine)
        self.adapters = Adapters(engine)
        self.adapter_files = AdapterFiles(engine)
        self.jobs = Jobs(engine)
        self.judgements = Judgements(engine)
        self.reads = Reads(engine)
        self.export = ExportReads(engine)
        self.guards = Guards(engine)
        self.reward_timeouts = RewardTimeouts(engine)
        self.sessions = Sessions(engine)
        self._releasing: set[asyncio.Task[int]] = set()  # seats given back for records refused without waiting
        self.evaluations = Evaluations(engine)
        self.trials = Trials(engine)

    @classmethod
    async def open(cls, url: str, *, capture: bool = True) -> Store:
        """Connect and migrate; with ``capture``, start the group-commit writer (the proxy's)."""
        engine = await connect(url)
        sync_engine = sqlite_sync_engine(engine) if capture and engine.dialect.name == "sqlite" else None
        store = cls(engine, sync_engine)
        if capture:
            store._writer = GroupCommitWriter(engine, sync_engine, asyncio.get_running_loop())
        return store

    async def close(self) -> None:
        """Write everything still queued, then release the connections."""
        if self._writer is not None:
            await self._writer.close()
            self._writer = None
        if self._held is not None:
            self._held.close()  # back to the pool, closed by dispose() below
            self._held = self._reader = None
        if self._sync is not None:
            self._sync.dispose()
        await self.engine.dispose()

    # -- captured calls ---------------------------------------------------------------

    @property
    def seats_with_records(self) -> bool:
        """The capture writer seats new trajectories (SQLite): on its own, or in their first call's record
        (``CallWrite.seat_in``)."""
        return self._writer is not None and self._sync is not None

    async def record_call(self, write: CallWrite, *, alone: bool = False) -> None:
        """Return once the transaction holding the call committed.

        ``alone``: the only call in flight in this process; on SQLite it is then committed on the
        event loop's thread when the writer is idle, sparing it the trip to the writer's thread.
        A write with ``seat_in`` seats its trajectory in the same transaction and carries its
        ``group_id`` afterwards. Stored compactly when it continues its trajectory's last recorded
        call (``store._compact``); ``write.call`` stays whole. A record that cannot be stored raises
        ``RecordRefused`` before it joins a batch (``store._record_check``), and its seat is given back.
        """
        assert self._writer is not None, "Store.open(capture=True) records calls"
        try:
            stored = self._stored(write)
        except RecordRefused:
            await self._release_seat(write)
            raise
        await self._writer.record(stored, alone=alone)
        write.group_id = write.call["group_id"] = stored.group_id
        self.chains.remember(write.trajectory_id, write.call, stored.call["prefix_messages"])

    def record_call_nowait(self, write: CallWrite) -> None:
        """Queue a call without waiting (its client is gone; nobody waits for the answer)."""
        assert self._writer is not None, "Store.open(capture=True) records calls"
        try:
            stored = self._stored(write)
        except RecordRefused as exc:
            log.warning("a call of trajectory %s was not recorded: %s", write.trajectory_id, exc)
            task = asyncio.get_running_loop().create_task(self._release_seat(write))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)
            return
        self._writer.record_nowait(stored)

    def _stored(self, write: CallWrite) -> CallWrite:
        """The row to queue: compact when it can be (``chains``), checked and encoded (``store._record_check``)."""
        return dataclasses.replace(write, call=checked_call(self.chains.stored_row(write.trajectory_id, write.call)))

    async def _release_seat(self, write: CallWrite) -> int:
        """Give back the seat a new trajectory took at keying (its row, still without calls: ``store._derived``),
        when its first call is not recorded."""
        if write.seat_in:
            return 0
        try:
            return await release_seats(self.engine, [write.trajectory_id], write.policy)
        except Exception as exc:  # the sweep gives it back later (release_stale_seats)
            log.warning("could not give back the seat of trajectory %s now: %s", write.trajectory_id, exc)
            return 0

    async def release_stale_seats(self, older_than_s: float) -> int:
        """Give back the seats taken more than ``older_than_s`` ago whose call was never recorded (a process
        died between keying and recording): their groups stop waiting for them (``store._derived``). A
        database that cannot take it now (a full disk) is left for the next sweep, with a warning."""
        try:
            with database_errors("give back stale seats"):
                return await release_stale_seats(self.engine, older_than_s)
        except StoreFull:  # the log tells a full disk once (store._full_disk); the next sweep tries again
            return 0
        except StoreUnavailable as exc:
            log.warning("%s; the next sweep tries again", exc)
            return 0

    # -- retention and disk -------------------------------------------------------------

    async def prune_trajectories(self, rule: PruneRule, *, dry_run: bool = False, batch: int = 200) -> PruneReport:
        """Delete old trajectories in batches (``store._retention``); this process's memory of them goes too."""
        report = await prune_trajectories(self.engine, rule, batch=batch, dry_run=dry_run)
        if not dry_run:
            self.chains.forget(report.trajectory_ids)
        return report

    async def vacuum(self) -> None:
        await vacuum(self.engine)

    def compact_memory(self) -> dict[str, int]:
        """What compact capture holds in this process's memory (``chains``, bounded in bytes): the trajectories
        whose last call is kept, the token ids kept with them, and the bytes of ids and messages together."""
        return {"trajectories": len(self.chains), "token_ids": self.chains.token_ids, "bytes": self.chains.held_bytes}

    async def disk_bytes(self) -> dict[str, int]:
        """Bytes of the store by part: calls, adapter_files, database (``store._usage``)."""
        return await store_bytes(self.engine)

    async def add_rewards(
        self,
        rewards: Iterable[RewardIn],
        policies: frozenset[str] | None = None,
        check: Callable[[set[str]], None] | None = None,
        weigh: Callable[[str, dict[str, float]], float] | None = None,
    ) -> list[RewardRecord]:
        """Record rewards all or none (``store._rewards``): ``policies``, when given, are the only ones whose
        trajectories exist for this batch; ``check`` may refuse the policies it rewards; ``weigh`` makes the reward
        of an item without one. A failing database raises ``StoreFull`` or ``StoreUnavailable``."""
        with database_errors("record the rewards"):
            return await add_rewards(self.engine, rewards, policies, check, weigh)

    # -- lookups for keying -------------------------------------------------------------

    async def _read(self, query: Callable[[Connection], _R]) -> _R:
        """A short read: synchronous on SQLite, through the async engine elsewhere."""
        if self._sync is not None:
            with self._sync.connect() as conn:
                return query(conn)
        async with self.engine.connect() as conn:
            return await conn.run_sync(query)

    async def trajectory_group(self, trajectory_id: str) -> tuple[str, str, int | None] | None:
        """(group_id, policy, served_by) of a stored trajectory, or None; ``served_by`` is the version that
        served its last recorded call (None while none is recorded: a seat taken ahead of its first call)."""
        if self._reader is not None:
            rows = self._reader.execute(_SQLITE_TRAJECTORY_GROUP, (trajectory_id,)).fetchall()
        else:
            async with self.engine.connect() as conn:
                rows = list((await conn.execute(_TRAJECTORY_GROUP, {"id": trajectory_id})).all())
        if not rows:
            return None
        group_id, policy, version, n_calls = rows[0]
        return group_id, policy, (int(version) if n_calls else None)

    async def group_policy(self, group_id: str) -> str | None:
        """The policy of a stored group, or None: a call that names a group may only join its own policy's."""
        if self._reader is not None:
            rows = self._reader.execute(_SQLITE_GROUP_POLICY, (group_id,)).fetchall()
        else:
            async with self.engine.connect() as conn:
                rows = list((await conn.execute(_GROUP_POLICY, {"id": group_id})).all())
        return str(rows[0][0]) if rows else None

    async def publishing_state(self) -> tuple[Any, ...]:
        """What the proxy's publisher acts on, in brief: it changes whenever an adapter of any policy
        changes state (a count moves), or a policy is added, retired or changed (its alias, training
        state or settings). Two reads; on SQLite through the event loop's own connection, so a poll
        every 100 ms costs microseconds."""
        if self._reader is not None:
            adapters = self._reader.execute(_SQLITE_ADAPTER_STATES).fetchall()
            state = self._reader.execute(_SQLITE_POLICY_STATE).fetchall()
        else:
            async with self.engine.connect() as conn:
                adapters = list((await conn.execute(_ADAPTER_STATES)).all())
                state = list((await conn.execute(_POLICY_STATE)).all())
        return tuple(tuple(row) for row in adapters), tuple(tuple(row) for row in state)

    async def find_open_thread(self, tail_hashes: Sequence[str], since: float) -> tuple[str, str, str, int] | None:
        """The unrewarded trajectory whose last request plus reply hashes to one of ``tail_hashes``.

        Earlier hashes in the sequence win (callers pass the longest prefix first).
        Returns (trajectory_id, group_id, tail_hash, the version that served its last call).
        """
        if not tail_hashes:
            return None
        rows: list[Any]
        if self._reader is not None:
            sql = _SQLITE_OPEN_THREADS.format(",".join("?" * len(tail_hashes)))
            rows = self._reader.execute(sql, (*tail_hashes, since)).fetchall()
        else:
            async with self.engine.connect() as conn:
                rows = list((await conn.execute(_OPEN_THREADS, {"tails": list(tail_hashes), "since": since})).all())
        by_hash = {row[2]: (row[0], row[1], row[2], int(row[3])) for row in rows}
        return next((by_hash[h] for h in tail_hashes if h in by_hash), None)

    async def join_task_group(
        self, policy: str, task_key: str, trajectory_id: str, *, keyed_by: str, group_size: int, alone: bool = False
    ) -> str:
        """The derived group of a new trajectory: a seat in the task's open group, shared by every replica.

        Stores the trajectory's row; if another replica stored it first, returns the group it gave it
        (see ``store._derived``). On SQLite with capture the writer's thread seats it (``alone``: as
        ``record_call``).
        """
        if self._writer is not None and self.seats_with_records:
            seat = Seat(policy, task_key, trajectory_id, keyed_by, group_size, time.time())
            return await self._writer.seat(seat, alone=alone)
        return await join_task_group(
            self.engine, policy=policy, task_key=task_key, trajectory_id=trajectory_id, keyed_by=keyed_by,
            group_size=group_size, now=time.time(),
        )  # fmt: skip

    async def claim_named(self, policy: str, trajectory_id: str, group_id: str, *, keyed_by: str) -> str:
        """The group of a new trajectory keyed into ``group_id``, the group its call names: both ids written for
        ``policy`` now, or ``KeyTaken`` when another policy took one first, on any replica (``store._derived``).
        A trajectory of ``policy`` stored before keeps its group."""
        return await claim_named(self.engine, policy=policy, trajectory_id=trajectory_id, group_id=group_id,
                                 keyed_by=keyed_by, now=time.time())  # fmt: skip
