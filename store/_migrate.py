"""Placeholder until the Alembic migrations land: create missing tables."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine
from sqlmodel import SQLModel


async def upgrade(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(SQLModel.metadata.create_all)
