"""Adapter versions: recording, claiming for publication, publishing (the alias itself: ``store._policies``).

The trainer records an adapter (``trained``); one proxy replica claims it (``loading``,
with a lease), loads it into every vLLM, marks it ``published`` and flips the policy's
``active_version``. A replica that dies while loading leaves the claim to expire; any
replica then takes it back (``trained`` again, ``reclaimed`` counted) and publishes it.

Across replicas: claims are taken with ``SELECT ... FOR UPDATE SKIP LOCKED`` on Postgres
(replicas polling together split the work instead of queueing on one row) and a guarded
move; only the claim's owner can mark its adapter published; a publisher's alias flip only
moves forward (``flip(..., forward_only=True)``), so a slow replica finishing an older
version never pulls the alias back; a version leaves the window once (``retired``), and
only the replica whose move won unloads it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import exists, func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from store._adapter_files import AdapterFile, write_files
from store._lifecycle import AdapterState, JobState, TrainingState, TrialState, move
from store._tables import adapters as A
from store._tables import policies as P
from store._tables import training_jobs as J
from store._tables import trials as TR
from store._version_retention import Pruned, prune_versions, pruned_versions

# A policy's name is also a directory (DATA_DIR/adapters/<policy>/): it starts with a letter or a digit, so it is
# never "." or "..", and holds no "/".
POLICY_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$"
ADAPTER_FIELDS = ("policy", "version", "path", "job_id", "state", "error", "metrics", "created_at", "published_at",
                  "lease_owner", "lease_expires_at", "reclaimed", "guard")  # fmt: skip


class Adapters:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def record(
        self,
        policy: str,
        version: int,
        path: str,
        job_id: int | None,
        metrics: dict[str, Any],
        files: Sequence[AdapterFile] = (),
        *,
        owner: str | None = None,
    ) -> bool:
        """A freshly trained adapter, waiting to be published; with ``files``, its files too, in one transaction.

        ``path`` is where the trainer wrote it; ``files`` reach a vLLM that cannot see that
        directory (``store._adapter_files``). With ``owner`` (the worker's), only while the job is
        still running under its claim and for the version the claim gave it: False, and nothing
        recorded, when the claim was lost meanwhile (its lease ran out and another worker took the job).
        """
        async with self._engine.begin() as conn:
            if owner is not None:
                mine = (J.c.id == job_id) & (J.c.worker == owner) & (J.c.version == version)
                claimed = await conn.execute(
                    update(J).where(mine, J.c.state == JobState.RUNNING.value).values(progress=0.9)
                )
                if not claimed.rowcount:
                    return False
            await conn.execute(
                A.insert().values(policy=policy, version=version, path=path, job_id=job_id,
                                  state=AdapterState.TRAINED.value, metrics=metrics, created_at=time.time())
            )  # fmt: skip
            await write_files(conn, policy, version, files)
        return True

    async def get(self, policy: str, version: int) -> dict[str, Any] | None:
        async with self._engine.connect() as conn:
            row = (await conn.execute(select(A).where(A.c.policy == policy, A.c.version == version))).first()
        return dict(row._mapping) if row else None

    async def of_policy(self, policy: str) -> list[dict[str, Any]]:
        async with self._engine.connect() as conn:
            rows = (await conn.execute(select(A).where(A.c.policy == policy).order_by(A.c.version))).all()
        return [dict(row._mapping) for row in rows]

    async def published_versions(self, policy: str) -> set[int]:
        async with self._engine.connect() as conn:
            rows = await conn.execute(
                select(A.c.version).where(A.c.policy == policy, A.c.state == AdapterState.PUBLISHED.value)
            )
            return {int(v) for v in rows.scalars()}

    async def claim_trained(
        self, policy: str, owner: str, lease_s: float, *, newest_only: bool = False
    ) -> list[tuple[int, str]]:
        """Claim every trained adapter of ``policy`` for publishing (``newest_only``: the newest, as a canary
        trial takes one version at a time); (version, path) of those this call won.

        Never one that ``Guards.discard_stale`` would discard (training paused, or its step began before the
        policy's last rollback): it may have been recorded after the publisher's discard and before this claim.
        """
        # correlate(A): the step's job, two levels down (auto-correlation reaches only the enclosing EXISTS)
        job_began = select(J.c.started_at).where(J.c.id == A.c.job_id).correlate(A).scalar_subquery()
        began = func.coalesce(job_began, A.c.created_at)
        stale = exists().where(
            P.c.name == A.c.policy, (P.c.training == TrainingState.PAUSED.value) | (began < P.c.rolled_back_at)
        )
        query = select(A.c.version, A.c.path).where(
            A.c.policy == policy, A.c.state == AdapterState.TRAINED.value, ~stale
        )
        query = query.order_by(A.c.version.desc()).limit(1) if newest_only else query.order_by(A.c.version)
        async with self._engine.begin() as conn:
            # Postgres: rows another replica is claiming are skipped.
            rows = (await conn.execute(query.with_for_update(skip_locked=True))).all()
            claimed = []
            for version, path in rows:
                won = await move(
                    conn, A, (A.c.policy == policy) & (A.c.version == version), AdapterState.TRAINED,
                    AdapterState.LOADING, lease_owner=owner, lease_expires_at=time.time() + lease_s,
                )  # fmt: skip
                if won:
                    claimed.append((int(version), str(path)))
        return claimed

    async def reclaim_expired(self, now: float | None = None) -> list[tuple[str, int, str | None]]:
        """Adapters left ``loading`` by a replica whose lease ran out: ``trained`` again, to be published.

        Returns (policy, version, previous owner) of each one this call took back.
        """
        now = time.time() if now is None else now
        expired = (A.c.state == AdapterState.LOADING.value) & (
            A.c.lease_expires_at.is_(None) | (A.c.lease_expires_at < now)
        )
        taken = []
        async with self._engine.begin() as conn:
            rows = (await conn.execute(select(A.c.policy, A.c.version, A.c.lease_owner).where(expired))).all()
            for policy, version, owner in rows:
                won = await move(
                    conn, A, (A.c.policy == policy) & (A.c.version == version) & expired, AdapterState.LOADING,
                    AdapterState.TRAINED, lease_owner=None, lease_expires_at=None, reclaimed=A.c.reclaimed + 1,
                )  # fmt: skip
                if won:
                    taken.append((str(policy), int(version), owner))
        return taken

    async def published(self, policy: str, version: int, owner: str | None = None) -> bool:
        """A version is now served: the one ``owner`` claimed, or (no owner: an admin activates it) any on disk.

        False when ``owner``'s claim was taken back meanwhile (another replica publishes it).
        """
        where = (A.c.policy == policy) & (A.c.version == version)
        olds: tuple[AdapterState, ...] = (AdapterState.LOADING, AdapterState.TRAINED, AdapterState.RETIRED,
                                          AdapterState.FAILED, AdapterState.ROLLED_BACK)  # fmt: skip
        if owner is not None:
            where, olds = where & (A.c.lease_owner == owner), (AdapterState.LOADING,)
        async with self._engine.begin() as conn:
            moved = await move(
                conn, A, where, olds, AdapterState.PUBLISHED, published_at=time.time(), error=None, lease_owner=None,
                lease_expires_at=None,
            )  # fmt: skip
        return bool(moved)

    async def retired(self, policy: str, version: int) -> bool:
        async with self._engine.begin() as conn:
            where = (A.c.policy == policy) & (A.c.version == version)
            return bool(await move(conn, A, where, AdapterState.PUBLISHED, AdapterState.RETIRED))

    async def failed(self, policy: str, version: int, reason: str) -> int | None:
        """Publishing failed: the adapter and the job that made it are marked failed. Returns the job id."""
        async with self._engine.begin() as conn:
            where = (A.c.policy == policy) & (A.c.version == version)
            await move(conn, A, where, AdapterState.LOADING, AdapterState.FAILED, error=reason, lease_owner=None,
                       lease_expires_at=None)  # fmt: skip
            job_id = (await conn.execute(select(A.c.job_id).where(where))).scalar()
            if job_id is not None:
                await move(conn, J, J.c.id == job_id, JobState.SUCCEEDED, JobState.FAILED,
                           error=f"publishing failed: {reason}")  # fmt: skip
        return None if job_id is None else int(job_id)

    async def version_to_train_on(self, policy: str) -> int:
        """The newest version not yet published, or on canary trial, if there is one; else the one the policy serves.

        A job queued while the previous step's adapter is still being published (or tried on a share
        of traffic: ``store._trials``) continues from that adapter instead of from the older version
        still serving. After a rollback no newer adapter is pending, so training continues from the
        version rolled back to.
        """
        on_trial = select(TR.c.candidate).where(TR.c.policy == policy, TR.c.state == TrialState.RUNNING.value)
        async with self._engine.connect() as conn:
            active = int((await conn.execute(select(P.c.active_version).where(P.c.name == policy))).scalar() or 0)
            pending = (
                await conn.execute(
                    select(func.max(A.c.version)).where(
                        A.c.policy == policy,
                        A.c.state.in_((AdapterState.TRAINED.value, AdapterState.LOADING.value))
                        | A.c.version.in_(on_trial.scalar_subquery()),
                        A.c.version > active,
                    )
                )
            ).scalar()
        return int(pending) if pending is not None else active

    async def newest_version(self, policy: str) -> int:
        async with self._engine.connect() as conn:
            newest = (await conn.execute(select(func.max(A.c.version)).where(A.c.policy == policy))).scalar()
        return int(newest or 0)

    async def count(self, policy: str) -> int:
        async with self._engine.connect() as conn:
            return int((await conn.execute(select(func.count()).where(A.c.policy == policy))).scalar_one())

    async def prune(self, policy: str, keep: int) -> list[Pruned]:
        """Retention: versions not kept lose their stored files and become ``pruned`` (``store._version_retention``)."""
        return await prune_versions(self._engine, policy, keep)

    async def pruned_versions(self, policy: str) -> set[int]:
        return await pruned_versions(self._engine, policy)
