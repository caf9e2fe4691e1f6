"""Canary trials: a newly published version serves a share of new trajectories until its rewards decide.

    the publisher (with --canary) loads version N ──▶ start(): N loading → published and a trial row
        (running; the version serving now is its baseline) in one transaction; trained versions
        older than N are passed over (discarded: N, trained after them, holds their steps)
    the canary (proxy.training._canary), about every second on every replica:
        evidence(): per complete group, each version's rewards over the group's trajectories that the
        trial served wholly by N or by the baseline; arms(): each version's trajectories and rewards
        ──▶ look(): the verdict so far, kept in the row for the dashboard and /metrics
    promote():   running → promoted; the alias flips from the baseline to N
    roll_back(): running → rolled_back; N published → rolled_back; the versions trained since N was
                 (all of them from N: training goes on from the newest) discarded; the policy's
                 ``rolled_back_at`` set, so a step still running from N is discarded when it records
                 (``store._guard.Guards.discard_stale``), and training goes on from the baseline

Each end is one transaction whose guarded moves decide who won: of replicas (or an admin and a
replica) ending the same trial together, one does; the others find it ended. One trial of a
policy runs at a time (the unique index ``ux_trials_running``): a replica that loaded another
version meanwhile gives its claim back (``start`` says "another trial runs") and the version
waits. A policy keeps its newest ``KEEP_TRIALS`` (1000) trials; older ended ones are deleted as
each trial ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, exists, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from store._lifecycle import AdapterState, GroupState, TrialState, move
from store._tables import adapters as A
from store._tables import calls as C
from store._tables import groups as G
from store._tables import policies as P
from store._tables import trajectories as T
from store._tables import trials as TR

TRIAL_FIELDS = ("id", "policy", "candidate", "baseline", "fraction", "state", "started_at", "ended_at", "decided_by",
                "reason", "verdict")  # fmt: skip
_T2 = T.alias("t2")
# Ended trials kept per policy (about 1-2 KB each with their last look): older ones are deleted as each ends.
KEEP_TRIALS = 1000
_MAX_EVIDENCE_ROWS = 20_000  # (group, version) rows a look reads at most: far beyond any trial's size bound


@dataclass(frozen=True, slots=True)
class GroupArms:
    """One complete group of a trial: how many of its trajectories each version served, their mean reward, and
    the sum of their rewards' squared deviations from that mean (``_ss``: their spread within the group)."""

    group_id: str
    candidate_n: int
    candidate_mean: float | None  # None when the candidate served none of it
    candidate_ss: float
    baseline_n: int
    baseline_mean: float | None
    baseline_ss: float
    completed_at: float  # when its last reward came
    window: bool = False  # a stratum of trajectories begun in one time window, not a group (``_canary_windows``)


@dataclass(frozen=True, slots=True)
class TrialUnit:
    """A group of a trial's trajectories that one version served wholly (an ungrouped conversation is a group of
    one): when its first began and it was last active, whether every one is rewarded, their mean reward, and when
    the last reward came."""

    group_id: str
    version: int
    begun_at: float
    active_at: float  # its last call or reward
    complete: bool  # every trajectory rewarded
    mean: float  # over its rewarded trajectories (0.0 when none is)
    rewarded_at: float  # its last reward's time (0.0 when none came)


@dataclass(frozen=True, slots=True)
class ArmTotals:
    """What one version of a trial served: its trajectories, how many are rewarded, their rewards' sums."""

    trajectories: int
    rewarded: int
    reward_sum: float
    reward_sq_sum: float


class _AnotherTrialRuns(Exception):
    pass


class _AliasMoved(Exception):
    pass


class Trials:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def running(self, policy: str) -> dict[str, Any] | None:
        async with self._engine.connect() as conn:
            row = (await conn.execute(select(TR).where(TR.c.policy == policy,
                                                       TR.c.state == TrialState.RUNNING.value))).first()  # fmt: skip
        return dict(row._mapping) if row else None

    async def get(self, trial_id: int) -> dict[str, Any] | None:
        async with self._engine.connect() as conn:
            row = (await conn.execute(select(TR).where(TR.c.id == trial_id))).first()
        return dict(row._mapping) if row else None

    async def newest(self, policy: str | None, limit: int) -> list[dict[str, Any]]:
        query = select(TR).order_by(TR.c.id.desc()).limit(limit)
        if policy is not None:
            query = query.where(TR.c.policy == policy)
        async with self._engine.connect() as conn:
            return [dict(row._mapping) for row in (await conn.execute(query)).all()]

    async def counts(self, policy: str) -> dict[str, int]:
        """Trials of ``policy`` by state."""
        query = select(TR.c.state, func.count()).where(TR.c.policy == policy).group_by(TR.c.state)
        async with self._engine.connect() as conn:
            return {str(state): int(n) for state, n in (await conn.execute(query)).all()}

    # -- begun by the publisher --------------------------------------------------------------------------------

    async def start(self, policy: str, candidate: int, owner: str, fraction: float) -> dict[str, Any] | str:
        """``owner``'s claimed, loaded ``candidate`` is published on trial against the version serving now.

        Returns the trial; or, with nothing changed, why not: "claim lost" (another replica took the
        claim back meanwhile: it publishes the version), "another trial runs" (the claim is still
        ``owner``'s: ``release`` it).
        """
        now = time.time()
        try:
            async with self._engine.begin() as conn:
                mine = (A.c.policy == policy) & (A.c.version == candidate) & (A.c.lease_owner == owner)
                if not await move(conn, A, mine, AdapterState.LOADING, AdapterState.PUBLISHED, published_at=now,
                                  error=None, lease_owner=None, lease_expires_at=None):  # fmt: skip
                    return "claim lost"
                baseline = (await conn.execute(select(P.c.active_version).where(P.c.name == policy))).scalar_one()
                row = {"policy": policy, "candidate": candidate, "baseline": int(baseline), "fraction": fraction,
                       "state": TrialState.RUNNING.value, "started_at": now}  # fmt: skip
                try:
                    trial_id = (await conn.execute(insert(TR).values(**row).returning(TR.c.id))).scalar_one()
                except IntegrityError:
                    raise _AnotherTrialRuns from None  # rolls back the adapter's move too
                older = (A.c.policy == policy) & (A.c.version < candidate)
                await move(
                    conn,
                    A,
                    older,
                    AdapterState.TRAINED,
                    AdapterState.DISCARDED,
                    error=f"passed over: {policy}@{candidate}, trained after it from it, went on trial",
                )
        except _AnotherTrialRuns:
            return "another trial runs"
        return {"id": int(trial_id), **row, "ended_at": None, "decided_by": None, "reason": None, "verdict": None}

    async def release(self, policy: str, version: int, owner: str) -> bool:
        """Give back a claim that could not start its trial: ``trained`` again, to wait for the next one."""
        async with self._engine.begin() as conn:
            mine = (A.c.policy == policy) & (A.c.version == version) & (A.c.lease_owner == owner)
            return bool(await move(conn, A, mine, AdapterState.LOADING, AdapterState.TRAINED, lease_owner=None,
                                   lease_expires_at=None))  # fmt: skip

    # -- read by the canary -----------------------------------------------------------------------------------

    def _window(self, trial: dict[str, Any]) -> list[Any]:
        """The trial's own trajectories: begun while it ran, with a recorded call, served by one of its versions."""
        where = [T.c.policy == trial["policy"], T.c.created_at >= trial["started_at"], T.c.n_calls > 0,
                 T.c.last_version.in_([trial["candidate"], trial["baseline"]])]  # fmt: skip
        if trial["ended_at"] is not None:
            where.append(T.c.created_at < trial["ended_at"])
        return where

    async def evidence(self, trial: dict[str, Any], *, min_group_size: int) -> list[GroupArms]:
        """Each complete group's rewards by version, oldest completed first.

        A group counts once every trajectory in it is rewarded (it has at least ``min_group_size``,
        and was not closed unrewarded), so a version whose rewards come sooner than the other's
        (shorter attempts end first) is not over-represented; and only trajectories served wholly by
        one version count (a call pinned to another version, or a trajectory that began before the
        trial, does not).
        """
        served_by_other = exists().where(C.c.trajectory_id == T.c.id, C.c.version != T.c.last_version)
        unrewarded_member = exists().where(_T2.c.group_id == T.c.group_id, _T2.c.reward.is_(None))
        members = select(func.count()).select_from(_T2).where(_T2.c.group_id == T.c.group_id).scalar_subquery()
        closed = select(G.c.id).where(G.c.policy == trial["policy"], G.c.state == GroupState.UNREWARDED.value)
        query = (
            select(T.c.group_id, T.c.last_version, func.count(), func.sum(T.c.reward),
                   func.sum(T.c.reward * T.c.reward), func.max(T.c.rewarded_at))
            .where(*self._window(trial), T.c.reward.is_not(None), ~served_by_other, ~unrewarded_member,
                   members >= min_group_size, T.c.group_id.not_in(closed))
            .group_by(T.c.group_id, T.c.last_version)
            .order_by(func.max(T.c.rewarded_at), T.c.group_id)
            .limit(_MAX_EVIDENCE_ROWS)
        )  # fmt: skip
        async with self._engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        by_group: dict[str, dict[str, Any]] = {}
        for group_id, version, n, total, squares, done in rows:
            arms = by_group.setdefault(group_id, {"candidate_n": 0, "candidate_mean": None, "candidate_ss": 0.0,
                                                  "baseline_n": 0, "baseline_mean": None, "baseline_ss": 0.0,
                                                  "completed_at": 0.0})  # fmt: skip
            arm = "candidate" if version == trial["candidate"] else "baseline"
            mean = float(total) / int(n)
            arms[f"{arm}_n"], arms[f"{arm}_mean"] = int(n), mean
            arms[f"{arm}_ss"] = max(0.0, float(squares) - int(n) * mean * mean)
            arms["completed_at"] = max(arms["completed_at"], float(done))
        groups = [GroupArms(group_id, **arms) for group_id, arms in by_group.items()]
        return sorted(groups, key=lambda g: (g.completed_at, g.group_id))

    async def units(self, trial: dict[str, Any]) -> list[TrialUnit]:
        """The trial's groups that one version served wholly, oldest begun first (a group holding both versions
        is the paired evidence, ``evidence``). A trajectory served by both versions does not count, nor does a
        group closed unrewarded (its rewards are not coming)."""
        served_by_other = exists().where(C.c.trajectory_id == T.c.id, C.c.version != T.c.last_version)
        closed = select(G.c.id).where(G.c.policy == trial["policy"], G.c.state == GroupState.UNREWARDED.value)
        query = (
            select(T.c.group_id, func.min(T.c.last_version), func.max(T.c.last_version), func.count(),
                   func.count(T.c.reward), func.sum(T.c.reward), func.min(T.c.created_at), func.max(T.c.updated_at),
                   func.max(T.c.rewarded_at))
            .where(*self._window(trial), ~served_by_other, T.c.group_id.not_in(closed))
            .group_by(T.c.group_id)
            .order_by(func.min(T.c.created_at), T.c.group_id)
            .limit(_MAX_EVIDENCE_ROWS)
        )  # fmt: skip
        async with self._engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [TrialUnit(str(group_id), int(low), float(begun), float(active), int(rewarded) == int(n),
                          float(total or 0.0) / int(rewarded) if rewarded else 0.0, float(done or 0.0))
                for group_id, low, high, n, rewarded, total, begun, active, done in rows if low == high]  # fmt: skip

    async def arms(self, trial: dict[str, Any]) -> dict[int, ArmTotals]:
        """What each of the trial's versions served: trajectories, rewarded, and their rewards' sums."""
        reward = func.coalesce(T.c.reward, 0.0)
        query = (
            select(T.c.last_version, func.count(), func.count(T.c.reward), func.sum(reward), func.sum(reward * reward))
            .where(*self._window(trial))
            .group_by(T.c.last_version)
        )
        async with self._engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        found = {int(v): ArmTotals(int(n), int(k), float(s or 0.0), float(q or 0.0)) for v, n, k, s, q in rows}
        return {v: found.get(v, ArmTotals(0, 0, 0.0, 0.0)) for v in (trial["candidate"], trial["baseline"])}

    async def look(self, trial_id: int, verdict: dict[str, Any]) -> None:
        """The canary's latest look at a running trial."""
        async with self._engine.begin() as conn:
            await conn.execute(
                update(TR).where(TR.c.id == trial_id, TR.c.state == TrialState.RUNNING.value).values(verdict=verdict)
            )

    # -- ended by the canary or an admin -------------------------------------------------------------------------

    async def promote(self, trial_id: int, *, by: str, reason: str, verdict: dict[str, Any] | None,
                      guard: dict[str, Any] | None = None) -> bool:  # fmt: skip
        """The candidate serves everything: the trial ends promoted and the alias flips to it, together.

        ``guard``: the regression guard's watch over the candidate from now on. False when the trial
        had ended already, or the alias no longer points at its baseline (nothing changed then).
        """
        now = time.time()
        try:
            async with self._engine.begin() as conn:
                trial = await _end(conn, trial_id, TrialState.PROMOTED, now, by, reason, verdict)
                if trial is None:
                    return False
                flipped = await conn.execute(
                    update(P).where(P.c.name == trial["policy"], P.c.active_version == trial["baseline"])
                    .values(active_version=trial["candidate"], updated_at=now)
                )  # fmt: skip
                if not flipped.rowcount:
                    raise _AliasMoved  # rolls the trial's end back too
                if guard is not None:
                    await conn.execute(
                        update(A)
                        .where(A.c.policy == trial["policy"], A.c.version == trial["candidate"])
                        .values(guard=guard)
                    )
        except _AliasMoved:
            return False
        return True

    async def roll_back(self, trial_id: int, *, by: str, reason: str, verdict: dict[str, Any] | None) -> bool:
        """The candidate serves nothing: the trial ends rolled back, the candidate is rolled back, the versions
        trained from it are discarded and training goes on from the baseline. False when it had ended."""
        now = time.time()
        async with self._engine.begin() as conn:
            trial = await _end(conn, trial_id, TrialState.ROLLED_BACK, now, by, reason, verdict)
            if trial is None:
                return False
            policy, candidate = trial["policy"], trial["candidate"]
            await move(conn, A, (A.c.policy == policy) & (A.c.version == candidate), AdapterState.PUBLISHED,
                       AdapterState.ROLLED_BACK, error=f"rolled back by its canary trial: {reason}")  # fmt: skip
            newer = (A.c.policy == policy) & (A.c.version > candidate)
            await move(
                conn,
                A,
                newer,
                AdapterState.TRAINED,
                AdapterState.DISCARDED,
                error=f"not published: trained from {policy}@{candidate}, which its trial rolled back",
            )
            await conn.execute(update(P).where(P.c.name == policy).values(rolled_back_at=now))
        return True


async def _forget_old(conn: AsyncConnection, policy: str, keep: int) -> None:
    """Delete the policy's ended trials beyond the newest ``keep`` (a running one is never among them)."""
    kept = select(TR.c.id).where(TR.c.policy == policy).order_by(TR.c.id.desc()).limit(keep)
    await conn.execute(
        delete(TR).where(TR.c.policy == policy, TR.c.state != TrialState.RUNNING.value, TR.c.id.not_in(kept))
    )


async def _end(
    conn: AsyncConnection, trial_id: int, to: TrialState, now: float, by: str, reason: str,
    verdict: dict[str, Any] | None,
) -> dict[str, Any] | None:  # fmt: skip
    """Move a running trial to ``to``; its row, or None when it was not running (another end came first)."""
    values: dict[str, Any] = {"ended_at": now, "decided_by": by, "reason": reason}
    if verdict is not None:
        values["verdict"] = verdict
    if not await move(conn, TR, TR.c.id == trial_id, TrialState.RUNNING, to, **values):
        return None
    row = dict((await conn.execute(select(TR).where(TR.c.id == trial_id))).one()._mapping)
    await _forget_old(conn, row["policy"], KEEP_TRIALS)
    return row
