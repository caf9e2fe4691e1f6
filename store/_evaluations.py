"""Evaluations: a version's scores on what it was not trained on, and who reads them (the trainer's loggers).

Whoever measures a version posts its scores (``POST /admin/evaluations``); they are rows here, in
the order they came (``id``). The trainer worker, which writes the run's metrics (``--log-to``),
reads what is new since the last id it logged (``since``) and logs each at its version's step: the
store is the seam between an evaluation in any process, on any machine, and the one process that
owns the run. At most ``KEEP`` rows per policy are kept; recording more deletes the oldest.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

from sqlalchemy import delete, func, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine

from store._tables import evaluations as E

KEEP = 10_000  # rows per policy: about a megabyte
EVALUATION_FIELDS = ("id", "policy", "version", "name", "value", "samples", "created_at")


class Evaluations:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def record(
        self, policy: str, version: int, scores: Mapping[str, float], *, samples: int | None = None
    ) -> list[dict[str, Any]]:
        """Write a version's scores in one transaction (finite numbers only: checked by the caller too)."""
        if not all(math.isfinite(v) for v in scores.values()):
            raise ValueError("evaluation scores must be finite numbers")
        now = time.time()
        rows = [{"policy": policy, "version": version, "name": name, "value": float(value), "samples": samples,
                 "created_at": now} for name, value in scores.items()]  # fmt: skip
        async with self._engine.begin() as conn:
            ids = [(await conn.execute(insert(E).values(**row).returning(E.c.id))).scalar_one() for row in rows]
            count = (await conn.execute(select(func.count()).where(E.c.policy == policy))).scalar_one()
            if count > KEEP:
                oldest = select(E.c.id).where(E.c.policy == policy).order_by(E.c.id).limit(count - KEEP)
                await conn.execute(delete(E).where(E.c.id.in_(oldest.scalar_subquery())))
        return [{"id": int(i), **row} for i, row in zip(ids, rows, strict=True)]

    async def since(self, policy: str, after_id: int = 0, *, limit: int = 500) -> list[dict[str, Any]]:
        """The policy's evaluations after ``after_id``, oldest first."""
        query = select(*(E.c[f] for f in EVALUATION_FIELDS)).where(E.c.policy == policy, E.c.id > after_id)
        async with self._engine.connect() as conn:
            rows = (await conn.execute(query.order_by(E.c.id).limit(limit))).all()
        return [dict(row._mapping) for row in rows]
