"""How many bytes the store takes, by part: captured calls, stored adapter files, the whole database.

SQLite: ``dbstat`` (the pages of each table and its indexes) and the file sizes (with its WAL);
one pass over the file, so callers ask now and then (the proxy every minute, in the background),
not per request. PostgreSQL: ``pg_total_relation_size`` and ``pg_database_size``, cheap.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

_SQLITE_PAGES = """
SELECT coalesce(m.tbl_name, d.name) AS owner, sum(d.pgsize)
FROM dbstat AS d LEFT JOIN sqlite_master AS m ON m.name = d.name
GROUP BY owner
"""
_POSTGRES = """
SELECT pg_total_relation_size('calls'), pg_total_relation_size('adapter_files'), pg_database_size(current_database())
"""


async def store_bytes(engine: AsyncEngine) -> dict[str, int]:
    """{"calls": ..., "adapter_files": ..., "database": ...}: bytes on disk (the database: every table, WAL too)."""
    async with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            calls, files, database = (await conn.execute(text(_POSTGRES))).one()
            return {"calls": int(calls), "adapter_files": int(files), "database": int(database)}
        pages = {str(owner): int(size) for owner, size in (await conn.execute(text(_SQLITE_PAGES))).all()}
    path = engine.url.database
    files_on_disk = 0
    if path and path != ":memory:":
        files_on_disk = sum(p.stat().st_size for p in _sqlite_files(Path(path)))
    return {
        "calls": pages.get("calls", 0),
        "adapter_files": pages.get("adapter_files", 0),
        "database": files_on_disk or sum(pages.values()),
    }


def _sqlite_files(path: Path) -> list[Path]:
    return [p for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")) if p.is_file()]
