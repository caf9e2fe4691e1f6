"""Opening the database: the async engine every process uses, and SQLite's connection settings.

SQLite runs in WAL mode with ``synchronous=NORMAL``: a committed record survives a crash of
the proxy process (not necessarily a power cut; use ``synchronous=FULL`` for that).
Opening brings the schema to the current revision (``store._migrate``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry

import store._tables  # noqa: F401  (registers the tables)
from store._migrate import upgrade
from store._record_check import Encoded

SQLITE_PRAGMAS = ("journal_mode=WAL", "synchronous=NORMAL", "busy_timeout=10000", "foreign_keys=OFF")


def dumps(value: Any) -> str:
    """A JSON column's text; a value the record check already encoded (``store._record_check.Encoded``) as it is."""
    if type(value) is Encoded:
        return value
    return orjson.dumps(value).decode()


def _on_connect_sqlite(dbapi_connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
    cursor = dbapi_connection.cursor()
    for pragma in SQLITE_PRAGMAS:
        cursor.execute(f"PRAGMA {pragma}")
    cursor.close()


async def connect(url: str, *, migrate: bool = True) -> AsyncEngine:
    """An async engine on the store, its schema brought to the current revision first."""
    if url.startswith("sqlite"):
        path = url.split(":///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    engine = create_async_engine(url, json_serializer=dumps, json_deserializer=orjson.loads)
    if engine.dialect.name == "sqlite":
        event.listen(engine.sync_engine, "connect", _on_connect_sqlite)
    if migrate:
        try:
            await upgrade(engine)
        except BaseException:
            await engine.dispose()
            raise
    return engine


def sqlite_sync_engine(engine: AsyncEngine) -> Engine:
    """A synchronous engine on the same SQLite file, for the writer thread and hot-path reads."""
    sync = create_engine(
        engine.url.set(drivername="sqlite"),
        json_serializer=dumps,
        json_deserializer=orjson.loads,
        connect_args={"check_same_thread": False},
    )
    event.listen(sync, "connect", _on_connect_sqlite)
    return sync


def insert_ignore(dialect: str, table: Any, keys: list[str]) -> Any:
    """INSERT ... ON CONFLICT DO NOTHING in the store's dialect."""
    module = postgresql if dialect == "postgresql" else sqlite
    return module.insert(table).on_conflict_do_nothing(index_elements=keys)
