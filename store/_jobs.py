"""Training jobs: made from ready groups, claimed by a trainer worker under a lease, finished once.

A group is *ready* when it is ``open``, every trajectory in it is rewarded and it has at
least ``min_group_size`` of them. One transaction creates a queued job and moves its
groups to ``training``, so a group is trained once whichever replica asked. A worker
claims a queued job with a lease (of the policy trained least recently: ``claim_next``) and
renews it while it trains; a job whose lease ran out (the worker died) is queued again by
whoever notices first, exactly once. One job of a policy runs at a time, and its claim
decides the adapter version it records.

When the worker shares its GPU with vLLM (``--share-gpu``), each step is a hand-over in the
job's ``gpu_state`` (``store.GpuHandover``): the worker asks (``request_gpu``) and waits; the
proxy finds the request (``pending_gpu_requests``), puts vLLM to sleep and grants it
(``grant_gpu``); the worker steps, records its adapter and gives the GPU back
(``release_gpu``); the proxy wakes vLLM. A job queued again because its worker died has its
hand-over revoked in the same transaction; the proxy revokes one that outlived its time
limit (``revoke_gpu``). The store is the only channel: the proxy and the worker never talk.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, case, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from store._compact import expand
from store._errors import database_errors
from store._gpu_handover import GpuHandovers
from store._lifecycle import GpuHandover, GroupState, JobState, PolicyState, move
from store._tables import adapters as A
from store._tables import calls as C
from store._tables import groups as G
from store._tables import policies as P
from store._tables import training_jobs as J
from store._tables import trajectories as T

JOB_FIELDS = ("id", "policy", "state", "group_ids", "version", "metrics", "progress", "error", "worker",
              "lease_expires_at", "reclaimed", "created_at", "started_at", "finished_at", "gpu_state",
              "gpu_requested_at", "gpu_granted_at", "gpu_released_at", "gpu_asleep_s")  # fmt: skip
_OTHERS = J.alias("others")  # the other jobs, beside the one a claim reads


@dataclass(frozen=True, slots=True)
class StoredCall:
    """What training reads of one captured call."""

    trajectory_id: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    status_code: int
    version: int
    # The sampling parameters the client's request named (None: it left them to the server's default).
    temperature: float | None = None
    top_p: float | None = None
    top_k: float | None = None
    min_p: float | None = None
    # The structured-output specification vLLM sampled it under (tracetrain_core.structured_outputs); None: none.
    structured_outputs: dict[str, Any] | None = None
    reward: float | None = None  # the call's own reward (POST /v1/rewards with its call_id), if any


@dataclass(frozen=True, slots=True)
class RewardedTrajectory:
    id: str
    group_id: str
    reward: float
    calls: list[StoredCall]
    metrics: dict[str, float] = field(default_factory=dict)  # the reward's components, as posted


def ready_condition(min_group_size: int, per_policy: Mapping[str, int] | None = None) -> Any:
    """The HAVING clause of a ready group, over ``groups`` outer-joined with its trajectories.

    ``per_policy``: policies whose groups need another least size than ``min_group_size``.
    """
    size = func.count(T.c.pk)
    least: Any = min_group_size
    if per_policy:
        least = case(*((G.c.policy == name, n) for name, n in sorted(per_policy.items())), else_=min_group_size)
    return and_(G.c.state == GroupState.OPEN.value, size >= least, func.count(T.c.reward) == size)


class Jobs(GpuHandovers):
    # -- made by the proxy -------------------------------------------------------------

    async def ready_groups(self, policy: str, min_group_size: int) -> list[str]:
        query = (
            select(G.c.id)
            .select_from(G.join(T, T.c.group_id == G.c.id))
            .where(G.c.policy == policy, G.c.state == GroupState.OPEN.value)
            .group_by(G.c.id, G.c.created_at)
            .having(ready_condition(min_group_size))
            .order_by(G.c.created_at)
        )
        async with self._engine.connect() as conn:
            return [row[0] for row in (await conn.execute(query)).all()]

    async def create(self, policy: str, group_ids: Sequence[str]) -> int | None:
        """A queued job over ``group_ids``, which move to ``training``; None if another replica took one first."""
        try:
            with database_errors("create a training job"):
                async with self._engine.begin() as conn:
                    job = insert(J).values(policy=policy, state=JobState.QUEUED.value, group_ids=list(group_ids),
                                           metrics={}, progress=0.0, created_at=time.time())  # fmt: skip
                    job_id = int((await conn.execute(job.returning(J.c.id))).scalar_one())
                    taken = await move(conn, G, G.c.id.in_(list(group_ids)), GroupState.OPEN, GroupState.TRAINING,
                                       job_id=job_id)  # fmt: skip
                    if taken != len(group_ids):
                        raise _TakenMeanwhile  # rolls the job back with the groups it did take
        except _TakenMeanwhile:
            return None
        return job_id

    # -- run by the trainer ------------------------------------------------------------

    async def claim(self, policy: str, owner: str, lease_s: float, *, first_version: int = 1) -> dict[str, Any] | None:
        """Take the oldest queued job of ``policy`` under a lease; None when there is none, when a job of the
        policy is running, or when another worker won.

        One job of a policy runs at a time, so each step trains on top of the one before, and the claim
        decides the version its step records: the policy's newest adapter + 1 (at least ``first_version``),
        returned and kept in the job's ``version``. Of workers claiming together, the unique index on running
        jobs (``ux_training_jobs_running``) lets one win; the version is computed inside the winning ``UPDATE``.
        """
        query = self._claimable().where(J.c.policy == policy).order_by(J.c.id)
        return await self._claim(query, owner, lease_s, lambda _: first_version)

    async def claim_next(
        self, owner: str, lease_s: float, *, policies: Sequence[str] | None = None,
        first_versions: Mapping[str, int] | None = None,
    ) -> dict[str, Any] | None:  # fmt: skip
        """Take a queued job of any policy (of ``policies``, when given) fairly: the policy trained least
        recently first (the oldest newest start of its jobs; one never trained before any), then its oldest job.

        A policy with a job running is skipped (one step of a policy at a time, as in ``claim``), and so is a
        retired one. With every policy always having work, the claims go round the policies: a job queued
        while N other policies have work starts within N claims, however many jobs those policies queued.
        ``first_versions``: the least version each policy's step records (``claim``'s ``first_version``).
        """
        newest_start = select(func.max(_OTHERS.c.started_at)).where(_OTHERS.c.policy == J.c.policy).scalar_subquery()
        retired = select(P.c.name).where(P.c.name == J.c.policy, P.c.state == PolicyState.RETIRED.value).exists()
        query = self._claimable().where(~retired).order_by(func.coalesce(newest_start, 0.0), J.c.id)
        if policies is not None:
            query = query.where(J.c.policy.in_(list(policies)))
        firsts = dict(first_versions or {})
        return await self._claim(query, owner, lease_s, lambda policy: firsts.get(policy, 1))

    @staticmethod
    def _claimable() -> Any:
        """Queued jobs of policies with no job running, locked as they are read (Postgres skips rows another
        worker is claiming: two workers claim two jobs, not one each try)."""
        running = select(_OTHERS.c.id).where(_OTHERS.c.policy == J.c.policy, _OTHERS.c.state == JobState.RUNNING.value)
        return (
            select(J).where(J.c.state == JobState.QUEUED.value, ~running.exists())
            .limit(1).with_for_update(of=J, skip_locked=True)
        )  # fmt: skip

    async def _claim(
        self, query: Any, owner: str, lease_s: float, first_version: Callable[[str], int]
    ) -> dict[str, Any] | None:
        try:
            async with self._engine.begin() as conn:
                job = (await conn.execute(query)).first()
                if job is None:
                    return None
                first = first_version(job.policy)
                newest = (
                    select(func.coalesce(func.max(A.c.version), 0) + 1).where(A.c.policy == job.policy)
                    .scalar_subquery()
                )  # fmt: skip
                now = time.time()
                won = await move(conn, J, J.c.id == job.id, JobState.QUEUED, JobState.RUNNING, worker=owner,
                                 started_at=now, progress=0.05, lease_expires_at=now + lease_s,
                                 version=case((newest > first, newest), else_=first))  # fmt: skip
                if not won:
                    return None
                version = (await conn.execute(select(J.c.version).where(J.c.id == job.id))).scalar_one()
        except IntegrityError:  # another worker's claim on a job of the policy came first
            return None
        return {**job._mapping, "worker": owner, "state": JobState.RUNNING.value, "started_at": now,
                "version": int(version)}  # fmt: skip

    async def renew(self, job_id: int, owner: str, lease_s: float, progress: float | None = None) -> bool:
        """Extend the lease (and report progress); False when the job is no longer this owner's."""
        values: dict[str, Any] = {"lease_expires_at": time.time() + lease_s}
        if progress is not None:
            values["progress"] = progress
        async with self._engine.begin() as conn:
            result = await conn.execute(
                update(J).where(J.c.id == job_id, J.c.worker == owner, J.c.state == JobState.RUNNING.value)
                .values(**values)
            )  # fmt: skip
        return bool(result.rowcount)

    async def finish(
        self, job_id: int, owner: str, *, ok: bool, metrics: dict[str, Any], version: int | None, error: str | None
    ) -> bool:
        """The step is over: the job and its groups move on. False when the claim was lost meanwhile."""
        async with self._engine.begin() as conn:
            job = (await conn.execute(select(J.c.group_ids).where(J.c.id == job_id))).one()
            won = await move(
                conn, J, (J.c.id == job_id) & (J.c.worker == owner), JobState.RUNNING,
                JobState.SUCCEEDED if ok else JobState.FAILED, metrics=metrics, version=version, error=error,
                progress=1.0, finished_at=time.time(), lease_expires_at=None,
            )  # fmt: skip
            if not won:
                return False
            await move(conn, G, G.c.id.in_(list(job.group_ids)), GroupState.TRAINING,
                       GroupState.TRAINED if ok else GroupState.FAILED)  # fmt: skip
        return True

    async def reclaim_expired(self, now: float | None = None) -> list[tuple[int, str | None]]:
        """Queue again every running job whose lease ran out; (job id, previous worker) of those taken back."""
        now = time.time() if now is None else now
        expired = (J.c.state == JobState.RUNNING.value) & (
            J.c.lease_expires_at.is_(None) | (J.c.lease_expires_at < now)
        )
        return await self._requeue(expired)

    async def release(self, job_id: int, owner: str) -> bool:
        """Give a claim back at once (its worker is known dead), without waiting for the lease."""
        return bool(await self._requeue((J.c.id == job_id) & (J.c.worker == owner)))

    async def _requeue(self, where: Any) -> list[tuple[int, str | None]]:
        taken = []
        async with self._engine.begin() as conn:
            rows = await conn.execute(select(J.c.id, J.c.worker).where(where, J.c.state == JobState.RUNNING.value))
            for job_id, worker in rows.all():
                won = await move(
                    conn, J, (J.c.id == job_id) & where, JobState.RUNNING, JobState.QUEUED, worker=None,
                    started_at=None, progress=0.0, lease_expires_at=None, reclaimed=J.c.reclaimed + 1, version=None,
                )  # fmt: skip
                if won:
                    taken.append((int(job_id), worker))
                    # Its worker is gone: a hand-over it asked for ends here, and the proxy wakes vLLM.
                    await move(conn, J, J.c.id == job_id, (GpuHandover.REQUESTED, GpuHandover.GRANTED),
                               GpuHandover.REVOKED, column="gpu_state", gpu_released_at=time.time())  # fmt: skip
        return taken

    async def running(self, policy: str | None = None) -> list[dict[str, Any]]:
        """The running jobs of every policy (of ``policy`` alone, when given)."""
        query = select(J).where(J.c.state == JobState.RUNNING.value)
        if policy is not None:
            query = query.where(J.c.policy == policy)
        async with self._engine.connect() as conn:
            return [dict(row._mapping) for row in (await conn.execute(query)).all()]

    async def group_policies(self, group_ids: Sequence[str]) -> dict[str, str]:
        """Group id -> its policy, for ``group_ids`` (rewards just written: whose jobs may be due)."""
        async with self._engine.connect() as conn:
            rows = await conn.execute(select(G.c.id, G.c.policy).where(G.c.id.in_(list(group_ids))))
            return {str(group): str(policy) for group, policy in rows.all()}

    async def rewarded_trajectories(self, group_ids: Sequence[str], *, policy: str) -> list[RewardedTrajectory]:
        """The rewarded trajectories of ``group_ids`` with their calls in order: what a step of ``policy`` trains on.

        Only ``policy``'s rows, whatever the groups hold: keying and the writer never put another policy's
        trajectory or call in a group (``KeyTaken``), and a job's data must not depend on that alone."""
        async with self._engine.connect() as conn:
            trajectories = (
                await conn.execute(
                    select(T.c.id, T.c.group_id, T.c.reward, T.c.metrics)
                    .where(T.c.group_id.in_(list(group_ids)), T.c.policy == policy, T.c.reward.is_not(None))
                    .order_by(T.c.pk)
                )
            ).all()
            ids = [row.id for row in trajectories]
            calls = (
                await conn.execute(
                    select(C.c.trajectory_id, C.c.prompt_token_ids, C.c.completion_token_ids, C.c.logprobs,
                           C.c.status_code, C.c.version, *(C.c.request[name].label(name) for name in _SAMPLING),
                           C.c.id, C.c.prefix_of, C.c.prefix_tokens, C.c.structured_outputs,
                           C.c.reward.label("call_reward"))
                    .where(C.c.trajectory_id.in_(ids), C.c.policy == policy)
                    .order_by(C.c.started_at, C.c.pk)
                )
            ).all()  # fmt: skip
        by_trajectory: dict[str, list[StoredCall]] = {i: [] for i in ids}
        for row in expand([dict(call._mapping) for call in calls]):  # compact prompts rebuilt (store._compact)
            del row["id"]
            reward = row.pop("call_reward")
            sampling = [_number(row.pop(name)) for name in _SAMPLING]
            spec = row.pop("structured_outputs")
            stored = StoredCall(*row.values(), *sampling)
            if isinstance(spec, dict) or reward is not None:
                stored = dataclasses.replace(
                    stored,
                    structured_outputs=spec if isinstance(spec, dict) else None,
                    reward=None if reward is None else float(reward),
                )
            by_trajectory[row["trajectory_id"]].append(stored)
        return [
            RewardedTrajectory(t.id, t.group_id, float(t.reward), by_trajectory[t.id], dict(t.metrics or {}))
            for t in trajectories
        ]

    async def sampling_window(self, trajectory_ids: Sequence[str]) -> tuple[float, float] | None:
        """When a step's trajectories were sampled: their first call's start and their last call's end (unix s)."""
        if not trajectory_ids:
            return None
        query = select(func.min(C.c.started_at), func.max(C.c.started_at + C.c.latency_ms / 1000.0)).where(
            C.c.trajectory_id.in_(list(trajectory_ids))
        )
        async with self._engine.connect() as conn:
            first, last = (await conn.execute(query)).one()
        return None if first is None else (float(first), float(last))

    # -- read by the dashboard and /metrics --------------------------------------------

    async def newest(self, limit: int, policy: str | None = None) -> list[dict[str, Any]]:
        """The newest ``limit`` jobs of every policy (of ``policy`` alone, when given)."""
        query = select(J).order_by(J.c.id.desc()).limit(limit)
        if policy is not None:
            query = query.where(J.c.policy == policy)
        async with self._engine.connect() as conn:
            return [dict(row._mapping) for row in (await conn.execute(query)).all()]

    async def counts(self, policy: str | None = None) -> dict[str, int]:
        """Jobs by state, of every policy (of ``policy`` alone, when given)."""
        query = select(J.c.state, func.count()).group_by(J.c.state)
        if policy is not None:
            query = query.where(J.c.policy == policy)
        async with self._engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return {str(state): int(n) for state, n in rows}

    async def counts_by_policy(self) -> dict[tuple[str, str], int]:
        """(policy, state) -> how many jobs: what /metrics shows."""
        async with self._engine.connect() as conn:
            rows = await conn.execute(select(J.c.policy, J.c.state, func.count()).group_by(J.c.policy, J.c.state))
            return {(str(policy), str(state)): int(n) for policy, state, n in rows.all()}

    async def last(self, state: JobState, policy: str | None = None) -> dict[str, Any] | None:
        """The newest job in ``state`` (succeeded: by finish time; running: the oldest running), of every policy
        (of ``policy`` alone, when given)."""
        order = J.c.finished_at.desc() if state is JobState.SUCCEEDED else J.c.id
        query = select(J).where(J.c.state == state.value).order_by(order).limit(1)
        if policy is not None:
            query = query.where(J.c.policy == policy)
        async with self._engine.connect() as conn:
            row = (await conn.execute(query)).first()
        return dict(row._mapping) if row else None


class _TakenMeanwhile(Exception):
    pass


# The request's sampling parameters training reads: JSON paths into each call's stored request, read in
# the query so the messages never leave the database.
_SAMPLING = ("temperature", "top_p", "top_k", "min_p")


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
