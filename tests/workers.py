"""What each pytest-xdist worker keeps to itself when ``make test`` runs the suite on several (``-n``).

Ports are ephemeral and temporary directories per worker already; the PostgreSQL database is not: the
store's tests wipe the one ``TRACETRAIN_TEST_POSTGRES_URL`` names. Each worker gets its own on that server,
named after it (``tracetrain_test_gw0``...), made on first use and kept for the next run.
"""

from __future__ import annotations

import asyncio

__all__ = ["worker_database"]


def worker_database(url: str, worker: str) -> str:
    """``url`` with its database renamed ``<database>_<worker>``, created on the server if it is not there."""
    import asyncpg
    from sqlalchemy.engine import make_url

    server = make_url(url)
    name = f"{server.database}_{worker}"

    async def create() -> None:
        conn = await asyncpg.connect(server.set(drivername="postgresql").render_as_string(hide_password=False))
        try:
            if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
                await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    asyncio.run(create())
    return server.set(database=name).render_as_string(hide_password=False)
