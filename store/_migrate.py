"""Schema migrations: bring any store to this release's schema, with Alembic (``store/migrations``).

Every process that opens the store calls ``upgrade``; at head it costs one query. A database is
one of:

    empty                       every revision runs
    LEGACY                      tracetrain 35c4648's tables and no ``alembic_version`` (that
                                release used create_all): stamped 0001_35c4648, then upgraded
    a revision this code knows  the revisions after it run
    a revision it does not      ``SchemaTooNew``: a newer tracetrain migrated it

The whole upgrade is one transaction. Replicas that start together must not race: on
PostgreSQL the transaction holds an advisory lock and reads the revision again once it has
it, so one replica migrates and the others wait, then find head. On SQLite an exclusive
``flock`` on ``<database>.migrate.lock`` does the same across processes. Within a process,
upgrades take turns whatever their databases (Alembic's ``op`` is a global).
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import hashlib
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Final

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, inspect, text
from sqlalchemy.exc import OperationalError, ProgrammingError
from sqlalchemy.ext.asyncio import AsyncEngine

from store._errors import SchemaTooNew, StoreError

log = logging.getLogger("tracetrain.store")

LEGACY: Final = "legacy"
"""``current_revision`` of a database tracetrain 35c4648 wrote: its tables, no migration history."""

FIRST: Final = "0001_35c4648"
"""The revision whose schema is exactly 35c4648's: a LEGACY database is stamped with it."""

# What tracetrain 35c4648's create_all made: a database holding these and no alembic_version is LEGACY.
_RELEASE_TABLES = frozenset(
    {"policies", "groups", "trajectories", "calls", "rewards", "training_jobs", "adapters", "judgements"}
)
# pg_advisory_xact_lock takes a signed 64-bit key; every tracetrain release must derive the same one.
_LOCK_KEY: Final = int.from_bytes(hashlib.sha256(b"tracetrain.migrate").digest()[:8], "big", signed=True)


@dataclass(frozen=True, slots=True)
class Upgrade:
    """What ``upgrade`` did. ``from_revision`` is None for an empty database; a LEGACY one counts as FIRST."""

    from_revision: str | None
    to_revision: str
    legacy: bool

    @property
    def changed(self) -> bool:
        return self.from_revision != self.to_revision


def alembic_config(connection: Connection | None = None) -> Config:
    """Alembic's configuration for the store's migrations on ``connection``, for tools and tests: e.g.
    ``command.downgrade(alembic_config(conn), FIRST)`` in a transaction on a sync connection."""
    config = Config()
    config.set_main_option("script_location", "store:migrations")
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@functools.cache
def _scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def revisions() -> tuple[str, ...]:
    """Every revision this release knows, oldest first."""
    return tuple(reversed([script.revision for script in _scripts().walk_revisions()]))


def head() -> str:
    """The newest revision: the schema of this release's tables (``store._tables``)."""
    newest = _scripts().get_current_head()
    assert newest is not None, "store/migrations/versions holds no revision"
    return newest


async def current_revision(engine: AsyncEngine) -> str | None:
    """The database's revision; LEGACY for one written by tracetrain 35c4648; None when it is empty."""
    async with engine.connect() as conn:
        return await conn.run_sync(_revision)


async def upgrade(engine: AsyncEngine) -> Upgrade:
    """Bring the database to ``head()``; see the module's docstring for what each kind of database gets.

    Raises ``SchemaTooNew`` when a newer tracetrain migrated the database; nothing is changed then.
    """
    recorded = await _recorded(engine)
    if recorded == head():
        return Upgrade(recorded, recorded, legacy=False)
    async with _alembic_in_this_process(), _sqlite_file_lock(engine), engine.begin() as conn:
        done = await conn.run_sync(_upgrade_locked)
    if done.changed:
        start = "tracetrain 35c4648's tables" if done.legacy else done.from_revision or "an empty database"
        log.info("schema upgraded from %s to %s", start, done.to_revision)
    return done


async def _recorded(engine: AsyncEngine) -> str | None:
    """The revision in alembic_version in one query; None when that table is missing or empty."""
    try:
        async with engine.connect() as conn:
            result = await conn.execute(text("SELECT version_num FROM alembic_version"))
            return result.scalar_one_or_none()
    except (OperationalError, ProgrammingError):  # no such table: _upgrade_locked looks closer
        return None


def _revision(conn: Connection) -> str | None:
    recorded = MigrationContext.configure(conn).get_current_revision()
    if recorded is not None:
        return recorded
    return LEGACY if _RELEASE_TABLES & set(inspect(conn).get_table_names()) else None


def _upgrade_locked(conn: Connection) -> Upgrade:
    if conn.dialect.name == "postgresql":
        # Held until this transaction ends; a replica that waited reads the revision afresh below
        # (READ COMMITTED gives each statement a new snapshot).
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})
    elif conn.dialect.name == "sqlite":
        # SQLite's DDL is transactional, but Python's sqlite3 opens no transaction before DDL:
        # begin one, so a failed revision leaves nothing half done.
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    found = _revision(conn)
    newest = head()
    if found == newest:
        return Upgrade(found, found, legacy=False)
    if found not in (None, LEGACY) and found not in revisions():
        raise SchemaTooNew(
            f"the database's schema is at revision {found}, which this tracetrain does not know (its newest is "
            f"{newest}): a newer tracetrain migrated it. Upgrade tracetrain (pip install -U tracetrain) to use it"
        )
    config = alembic_config(conn)
    legacy = found == LEGACY
    if legacy:
        if missing := _RELEASE_TABLES - set(inspect(conn).get_table_names()):
            raise StoreError(
                f"the database has some of tracetrain's tables but not {', '.join(sorted(missing))}, and no migration "
                "history: it was not written by tracetrain 35c4648, so it cannot be upgraded in place"
            )
        command.stamp(config, FIRST)
        found = FIRST
    command.upgrade(config, "head")
    return Upgrade(found, newest, legacy=legacy)


# Alembic's `op` and `context` are module globals, so two upgrades in one process (two stores, or two
# engines on one loop, whose statements interleave at every await) must not overlap, whatever their databases.
_ALEMBIC = threading.Lock()


@asynccontextmanager
async def _alembic_in_this_process() -> AsyncIterator[None]:
    # Polled, not awaited in a thread: the waiter may be on any loop or thread, and may be cancelled.
    while not _ALEMBIC.acquire(blocking=False):
        await asyncio.sleep(0.02)
    try:
        yield
    finally:
        _ALEMBIC.release()


@asynccontextmanager
async def _sqlite_file_lock(engine: AsyncEngine) -> AsyncIterator[None]:
    """An exclusive flock on ``<database>.migrate.lock``, held while the block runs; a no-op off SQLite files.

    BEGIN IMMEDIATE alone would serialise the upgrades too, but a waiter gives up after SQLite's busy
    timeout; this lock waits for as long as a migration takes.
    """
    database = engine.url.database
    if engine.dialect.name != "sqlite" or not database or database == ":memory:" or "mode=memory" in str(engine.url):
        yield
        return
    with open(f"{database}.migrate.lock", "a") as lock:  # "a": created when missing, never truncated
        while True:  # polled like _ALEMBIC, so a cancelled waiter leaves nothing behind
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(0.02)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
