"""Dashboard sessions ended on the server: a logout, or every session at once.

A session cookie is signed by the proxy (``proxy._credentials``) and checked without the store, so
that every replica sharing the admin token accepts it. Ending one before it expires needs shared
state: its nonce is written here when its owner logs out, and ``*`` with a time ends every session
issued before that time. Each request that rides on a session asks ``revoked`` (one indexed read;
admin requests are few). A row is useless once the session would have expired anyway, and goes at
the next revocation.
"""

from __future__ import annotations

import time

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncEngine

from store._engine import insert_ignore
from store._tables import revoked_sessions as R

ALL_SESSIONS = "*"


class Sessions:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def revoke(self, nonce: str, expires_at: float) -> None:
        """End the session ``nonce`` (it would have expired at ``expires_at``) on every replica."""
        await self._write(nonce, expires_at)

    async def revoke_all(self, session_s: float) -> None:
        """End every session issued until now (``session_s``: how long a session lives)."""
        now = time.time()
        async with self._engine.begin() as conn:
            await conn.execute(delete(R).where(R.c.nonce == ALL_SESSIONS))
        await self._write(ALL_SESSIONS, now + session_s, now)

    async def revoked(self, nonce: str, issued_at: float) -> bool:
        """Whether the session ``nonce``, issued at ``issued_at``, was ended on the server."""
        query = select(R.c.nonce, R.c.revoked_at).where(R.c.nonce.in_([nonce, ALL_SESSIONS]))
        async with self._engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return any(row[0] == nonce or issued_at <= float(row[1]) for row in rows)

    async def _write(self, nonce: str, expires_at: float, now: float | None = None) -> None:
        now = time.time() if now is None else now
        row = {"nonce": nonce, "revoked_at": now, "expires_at": expires_at}
        async with self._engine.begin() as conn:
            await conn.execute(delete(R).where(R.c.expires_at < now))
            await conn.execute(insert_ignore(self._engine.dialect.name, R, ["nonce"]).values(**row))
