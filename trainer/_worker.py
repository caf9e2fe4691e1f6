"""The trainer worker: claims a queued job from the store, trains one step, records the adapter.

    store (queued job) --claim--> load its groups' trajectories --> build samples and advantages
        --> Learner.step --> <data>/adapters/<policy>/<N>/ --> adapters row (state "trained")

The proxy publishes what the worker records (``proxy.training._publisher``). The worker trains
on top of the version the policy serves: after a rollback or a failed publish it
reloads that version's adapter first. It never talks to vLLM or the proxy; the store
is the only thing they share, so the worker can run on its own GPU machine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from store._store import A, G, J, P, connect
from trainer._batch import build_batch, load_trajectories
from trainer._config import TrainConfig
from trainer._learner import Learner, TrainItem

log = logging.getLogger("tracetrain.trainer")

# The line the worker logs once it can train; `tracetrain serve` waits for it in the log.
READY_LINE = "trainer worker ready"


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    database_url: str
    data_dir: Path
    policy: str
    base_model: Path  # the HF model directory vLLM serves as the base
    config: TrainConfig
    init_adapter: Path | None = None  # a LoRA to start from (an SFT warm start) instead of a fresh one
    device: str = "cpu"
    poll_s: float = 1.0

    @property
    def adapters_dir(self) -> Path:
        return self.data_dir / "adapters" / self.policy


class Worker:
    def __init__(self, settings: WorkerSettings, engine: AsyncEngine) -> None:
        self.settings = settings
        self._engine = engine
        self._name = f"{socket.gethostname()}:{os.getpid()}"
        self._learner: Learner | None = None
        self._learner_version = -1  # the adapter version the learner's weights are

    @classmethod
    async def open(cls, settings: WorkerSettings) -> Worker:
        return cls(settings, await connect(settings.database_url))

    async def prepare(self) -> None:
        """Requeue the jobs a dead worker of this host left running, and load the model now.

        Loading before the first job makes the first step as fast as the others, and lets
        ``tracetrain serve`` say the trainer is ready when it is (it waits for ``READY_LINE``).
        """
        await self._requeue_orphans()
        await asyncio.to_thread(self._learner_at, await self._version_to_train_on())
        log.info("%s: policy %s, base model %s, device %s", READY_LINE, self.settings.policy,
                 self.settings.base_model, self.settings.device)  # fmt: skip

    async def _requeue_orphans(self) -> None:
        host = socket.gethostname()
        async with self._engine.begin() as conn:
            running = (
                await conn.execute(select(J.c.id, J.c.worker).where(J.c.policy == self.settings.policy,
                                                                     J.c.state == "running"))
            ).all()  # fmt: skip
            for job_id, worker in running:
                worker_host, _, pid = str(worker).rpartition(":")
                if worker_host == host and pid.isdigit() and not _alive(int(pid)):
                    await conn.execute(
                        update(J).where(J.c.id == job_id, J.c.state == "running")
                        .values(state="queued", worker=None, started_at=None, progress=0.0)
                    )  # fmt: skip
                    log.warning("job %s: its worker %s is gone; queued again", job_id, worker)

    async def close(self) -> None:
        await self._engine.dispose()

    async def run(self, *, once: bool = False) -> int:
        """Run jobs until cancelled (or, with ``once``, until no job is queued); returns jobs run."""
        done = 0
        while True:
            job = await self.claim()
            if job is None:
                if once:
                    return done
                await asyncio.sleep(self.settings.poll_s)
                continue
            await self.run_job(job)
            done += 1

    async def claim(self) -> dict[str, Any] | None:
        """Take the oldest queued job of the policy; None when there is none."""
        async with self._engine.begin() as conn:
            job = (
                await conn.execute(
                    select(J).where(J.c.policy == self.settings.policy, J.c.state == "queued").order_by(J.c.id).limit(1)
                )
            ).first()
            if job is None:
                return None
            taken = await conn.execute(
                update(J)
                .where(J.c.id == job.id, J.c.state == "queued")
                .values(state="running", worker=self._name, started_at=time.time(), progress=0.05)
            )
            return dict(job._mapping) if taken.rowcount == 1 else None

    async def run_job(self, job: dict[str, Any]) -> None:
        try:
            metrics, version = await self._train(job)
        except Exception as exc:
            log.exception("training job %s failed", job["id"])
            await self._finish(job, "failed", {}, None, f"{type(exc).__name__}: {exc}")
            return
        await self._finish(job, "succeeded", metrics, version, None)

    async def _train(self, job: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
        base = await self._version_to_train_on()
        learner = await asyncio.to_thread(self._learner_at, base)
        trajectories = await load_trajectories(self._engine, job["group_ids"])
        batch = build_batch(trajectories, self.settings.config, trained_version=base)
        if not batch.samples:
            log.warning("job %s: nothing to learn from (%s)", job["id"], batch.metrics)
            return {**batch.metrics, "skipped": "no sample carries a signal"}, None
        await self._progress(job["id"], 0.2)
        items = [
            TrainItem(sample, advantage) for sample, advantage in zip(batch.samples, batch.advantages, strict=True)
        ]
        result = await asyncio.to_thread(learner.step, items)
        version = await self._next_version()
        metrics = {**batch.metrics, **result.to_dict(), "version": version, "trained_from": base}
        out_dir = self.settings.adapters_dir / str(version)
        await asyncio.to_thread(learner.save, out_dir, metrics)
        self._learner_version = version
        async with self._engine.begin() as conn:
            await conn.execute(
                A.insert().values(policy=self.settings.policy, version=version, path=str(out_dir.resolve()),
                                  job_id=job["id"], state="trained", metrics=metrics, created_at=time.time())
            )  # fmt: skip
        log.info("job %s: trained %s@%d (loss %.4f, reward mean %.3f, %.1f s)", job["id"], self.settings.policy,
                 version, result.loss, batch.metrics["reward_mean"], result.seconds)  # fmt: skip
        return metrics, version

    def _learner_at(self, version: int) -> Learner:
        """The learner holding ``version``'s weights (built or reloaded when it holds another)."""
        if self._learner is not None and self._learner_version == version:
            return self._learner
        settings = self.settings
        adapter = settings.adapters_dir / str(version) if version > 0 else settings.init_adapter
        if adapter is not None and not adapter.is_dir():
            raise FileNotFoundError(f"the adapter to train from is missing: {adapter}")
        self._learner = Learner(settings.base_model, settings.config, adapter=adapter, device=settings.device)
        self._learner_version = version
        return self._learner

    async def _version_to_train_on(self) -> int:
        """The newest version not yet published if there is one, else the one the policy serves.

        A job queued while the previous step's adapter is still being published continues
        from that adapter instead of from the older version still serving. After a rollback
        no newer adapter is pending, so training continues from the version rolled back to.
        """
        policy = self.settings.policy
        async with self._engine.connect() as conn:
            active = int((await conn.execute(select(P.c.active_version).where(P.c.name == policy))).scalar() or 0)
            pending = (
                await conn.execute(
                    select(func.max(A.c.version)).where(
                        A.c.policy == policy, A.c.state.in_(("trained", "loading")), A.c.version > active
                    )
                )
            ).scalar()
        return int(pending) if pending is not None else active

    async def _next_version(self) -> int:
        async with self._engine.connect() as conn:
            newest = (
                await conn.execute(select(func.max(A.c.version)).where(A.c.policy == self.settings.policy))
            ).scalar()
        on_disk = [int(p.name) for p in self.settings.adapters_dir.glob("*") if p.name.isdigit()]
        return max([int(newest or 0), *on_disk]) + 1

    async def _progress(self, job_id: int, progress: float) -> None:
        async with self._engine.begin() as conn:
            await conn.execute(update(J).where(J.c.id == job_id).values(progress=progress))

    async def _finish(
        self, job: dict[str, Any], state: str, metrics: dict[str, Any], version: int | None, error: str | None
    ) -> None:
        async with self._engine.begin() as conn:
            await conn.execute(
                update(J)
                .where(J.c.id == job["id"])
                .values(state=state, metrics=metrics, version=version, error=error, progress=1.0,
                        finished_at=time.time())
            )  # fmt: skip
            await conn.execute(
                update(G)
                .where(G.c.id.in_(job["group_ids"]))
                .values(state="trained" if state == "succeeded" else "failed")
            )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
