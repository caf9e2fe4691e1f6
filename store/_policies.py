"""Policies: the names agents use as ``model``, their alias, their settings and their life cycle.

A policy row is made the first time a proxy serves the name (``ensure``, ``add``). It holds the
version ``NAME`` routes to (``active_version``, moved by ``flip``), whether it trains
(``training``, the regression guard's), the settings it overrides (``config``: JSON, read by every
proxy replica and the trainer, so they all apply the same ones) and whether it is served
(``state``: ``serving``, or ``retired`` by an admin; ``store.PolicyState``). Retiring changes no
other row: the policy's trajectories, groups, jobs and adapters stay readable, and adding it again
serves it from the version it served before.
"""

from __future__ import annotations

import enum
import time
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from store._engine import insert_ignore
from store._lifecycle import PolicyState, move
from store._tables import policies as P


class PolicyAdded(enum.StrEnum):
    """What ``Policies.add`` did."""

    ADDED = "added"  # a new policy
    READDED = "readded"  # a retired one serves again
    SERVING = "serving"  # it was served already (its settings replaced when some were given)


class Policies:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def ensure(self, name: str, base_model: str) -> int:
        """Create the policy row if missing (serving, no settings of its own); return its active version."""
        now = time.time()
        async with self._engine.begin() as conn:
            await conn.execute(
                insert_ignore(self._engine.dialect.name, P, ["name"]),
                [{"name": name, "base_model": base_model, "active_version": 0, "created_at": now, "updated_at": now,
                  "state": PolicyState.SERVING.value}],
            )  # fmt: skip
            row = (await conn.execute(select(P.c.active_version).where(P.c.name == name))).one()
        return int(row[0])

    async def add(self, name: str, base_model: str, config: dict[str, Any] | None = None) -> PolicyAdded:
        """Serve ``name``: a new row, or a retired policy served again. ``config`` (when given) replaces the
        settings it overrides; None keeps what it had (a new one then has none)."""
        now = time.time()
        async with self._engine.begin() as conn:
            made = await conn.execute(
                insert_ignore(self._engine.dialect.name, P, ["name"]),
                [{"name": name, "base_model": base_model, "active_version": 0, "created_at": now, "updated_at": now,
                  "state": PolicyState.SERVING.value, "config": config}],
            )  # fmt: skip
            if made.rowcount:
                return PolicyAdded.ADDED
            readded = await move(conn, P, P.c.name == name, PolicyState.RETIRED, PolicyState.SERVING, retired_at=None,
                                 updated_at=now)  # fmt: skip
            if config is not None:
                await conn.execute(update(P).where(P.c.name == name).values(config=config, updated_at=now))
        return PolicyAdded.READDED if readded else PolicyAdded.SERVING

    async def configure(self, name: str, config: dict[str, Any]) -> bool:
        """Replace the settings ``name`` overrides; False when there is no such policy."""
        async with self._engine.begin() as conn:
            changed = await conn.execute(
                update(P).where(P.c.name == name).values(config=config, updated_at=time.time())
            )
        return bool(changed.rowcount)

    async def retire(self, name: str) -> bool:
        """Stop serving and training ``name`` (its rows stay); False when it was not served."""
        now = time.time()
        async with self._engine.begin() as conn:
            return bool(await move(conn, P, P.c.name == name, PolicyState.SERVING, PolicyState.RETIRED, retired_at=now,
                                   updated_at=now))  # fmt: skip

    async def get(self, name: str) -> dict[str, Any] | None:
        async with self._engine.connect() as conn:
            row = (await conn.execute(select(P).where(P.c.name == name))).first()
        return _row(row._mapping) if row else None

    async def active_version(self, name: str) -> int | None:
        async with self._engine.connect() as conn:
            value = (await conn.execute(select(P.c.active_version).where(P.c.name == name))).scalar()
        return None if value is None else int(value)

    async def flip(self, name: str, version: int, *, forward_only: bool = False) -> bool:
        """Point the policy's alias at ``version``; ``forward_only``: only if it serves an older one.

        Returns whether the alias moved (or already pointed there).
        """
        where = P.c.name == name
        if forward_only:
            where &= P.c.active_version <= version
        async with self._engine.begin() as conn:
            moved = await conn.execute(update(P).where(where).values(active_version=version, updated_at=time.time()))
        return bool(moved.rowcount)

    async def all(self) -> list[dict[str, Any]]:
        """Every policy, retired ones too, by name."""
        async with self._engine.connect() as conn:
            rows = (await conn.execute(select(P).order_by(P.c.name))).all()
        return [_row(row._mapping) for row in rows]

    async def serving(self) -> list[dict[str, Any]]:
        """The policies served now, by name."""
        return [row for row in await self.all() if row["state"] == PolicyState.SERVING]


def _row(mapping: Any) -> dict[str, Any]:
    row = dict(mapping)
    row["config"] = dict(row.get("config") or {})
    return row
