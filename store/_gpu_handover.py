"""The GPU hand-over of a running job, in its row (``training_jobs.gpu_state``; ``tracetrain serve --share-gpu``).

The worker asks (``request_gpu``) and waits; the proxy finds the request (``pending_gpu_requests``),
puts vLLM to sleep and grants it (``grant_gpu``); the worker steps, records its adapter and gives the
GPU back (``release_gpu``); the proxy wakes vLLM. The proxy ends a hand-over whose worker is gone or
whose step outlived its time limit (``revoke_gpu``). Each move is one guarded update
(``store._lifecycle``). ``store.Jobs`` has these as its own.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from store._lifecycle import GpuHandover, JobState, move
from store._tables import training_jobs as J

_HANDOVER_FIELDS = (J.c.id, J.c.policy, J.c.state, J.c.worker, J.c.lease_expires_at, J.c.gpu_state,
                    J.c.gpu_requested_at, J.c.gpu_granted_at, J.c.gpu_released_at, J.c.gpu_asleep_s)  # fmt: skip
_OPEN_HANDOVER = (GpuHandover.REQUESTED.value, GpuHandover.GRANTED.value)


class GpuHandovers:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def request_gpu(self, job_id: int, owner: str) -> bool:
        """The worker asks for the GPU for its step; False when the job is no longer its own."""
        mine = (J.c.id == job_id) & (J.c.worker == owner) & (J.c.state == JobState.RUNNING.value)
        async with self._engine.begin() as conn:
            return bool(
                await move(
                    conn, J, mine, (GpuHandover.NONE, GpuHandover.RELEASED, GpuHandover.REVOKED),
                    GpuHandover.REQUESTED, column="gpu_state", gpu_requested_at=time.time(), gpu_granted_at=None,
                    gpu_released_at=None, gpu_asleep_s=None,
                )
            )  # fmt: skip

    async def pending_gpu_requests(self, policy: str | None = None) -> list[dict[str, Any]]:
        """The open hand-overs (requested or granted) of every policy (of ``policy`` alone, when given), oldest
        request first: the proxy's to serve, one at a time, whichever policy's step asks."""
        query = select(*_HANDOVER_FIELDS).where(J.c.gpu_state.in_(_OPEN_HANDOVER))
        if policy is not None:
            query = query.where(J.c.policy == policy)
        async with self._engine.connect() as conn:
            rows = await conn.execute(query.order_by(J.c.gpu_requested_at, J.c.id))
            return [dict(row._mapping) for row in rows.all()]

    async def gpu_handover(self, job_id: int) -> dict[str, Any] | None:
        """A job's hand-over as it stands: its state, worker and lease, ``gpu_state`` and times."""
        async with self._engine.connect() as conn:
            row = (await conn.execute(select(*_HANDOVER_FIELDS).where(J.c.id == job_id))).first()
        return dict(row._mapping) if row else None

    async def grant_gpu(self, job_id: int) -> bool:
        """vLLM sleeps: the GPU is the worker's. False when the job stopped running meanwhile."""
        running = (J.c.id == job_id) & (J.c.state == JobState.RUNNING.value)
        async with self._engine.begin() as conn:
            return bool(await move(conn, J, running, GpuHandover.REQUESTED, GpuHandover.GRANTED, column="gpu_state",
                                   gpu_granted_at=time.time()))  # fmt: skip

    async def release_gpu(self, job_id: int, owner: str) -> bool:
        """The worker's step is over (its adapter recorded, or it failed); False when it was revoked meanwhile."""
        async with self._engine.begin() as conn:
            return bool(await move(conn, J, (J.c.id == job_id) & (J.c.worker == owner), GpuHandover.GRANTED,
                                   GpuHandover.RELEASED, column="gpu_state", gpu_released_at=time.time()))  # fmt: skip

    async def revoke_gpu(self, job_id: int) -> bool:
        """The proxy ends a hand-over whose worker is gone or whose step took too long; False if it ended first."""
        async with self._engine.begin() as conn:
            return bool(await move(conn, J, J.c.id == job_id, (GpuHandover.REQUESTED, GpuHandover.GRANTED),
                                   GpuHandover.REVOKED, column="gpu_state", gpu_released_at=time.time()))  # fmt: skip

    async def record_gpu_asleep(self, job_id: int, seconds: float) -> None:
        """How long vLLM slept for the job's step, written by the proxy once vLLM is awake again."""
        async with self._engine.begin() as conn:
            await conn.execute(update(J).where(J.c.id == job_id).values(gpu_asleep_s=seconds))
