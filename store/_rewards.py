"""Rewards written: recorded in one transaction, or not at all.

A reward has a source (``REWARD_SOURCES``): "service" (posted to ``POST /v1/rewards``), "judge"
(the LLM judge's score, ``store._judgements``) or "human" (a person's score, with a note). Every
reward is kept in ``rewards``; the trajectory holds the one that trains: a person's score over
any other (``not_by_a_person``: a service's or the judge's later reward is recorded beside it, never
over it), else the latest.

A reward may name one call of its trajectory (``call_id``): it is kept in ``rewards`` and on the call
(``calls.reward``, the latest wins), and leaves the trajectory's own reward as it was: a trajectory is
rewarded, and its group ready, only by a reward of the whole trajectory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import ColumnElement, bindparam, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from store._errors import UnknownCalls, UnknownTrajectories
from store._tables import calls as C
from store._tables import rewards as R
from store._tables import trajectories as T

REWARD_SOURCES = ("service", "judge", "human")


def not_by_a_person() -> ColumnElement[bool]:
    """The trajectory holds no person's score: another source's reward may replace what it holds."""
    return or_(T.c.reward_source.is_(None), T.c.reward_source != "human")


@dataclass(frozen=True, slots=True)
class RewardIn:
    trajectory_id: str
    reward: float | None  # None: ``add_rewards``' ``weigh`` makes it of the metrics
    metrics: dict[str, float] = field(default_factory=dict)
    source: str = "service"  # "service" or "human": what add_rewards writes
    explanation: str | None = None  # a person's note
    call_id: str | None = None  # one call of the trajectory; None: the whole trajectory
    demonstration: str | None = None  # a person's: the answer they wanted (kept on the trajectory)


@dataclass(frozen=True, slots=True)
class RewardRecord:
    """A reward as written, from one of ``REWARD_SOURCES``."""

    trajectory_id: str
    group_id: str
    reward: float
    metrics: dict[str, float]
    source: str
    explanation: str | None
    created_at: float
    call_id: str | None = None  # the call rewarded; None: the whole trajectory

    @classmethod
    def of_row(cls, row: Mapping[str, Any]) -> RewardRecord:
        """A row of the ``rewards`` table."""
        return cls(row["trajectory_id"], row["group_id"], row["value"], row["metrics"], row["source"],
                   row["explanation"], row["created_at"], row.get("call_id"))  # fmt: skip

    def row(self) -> dict[str, Any]:
        """Its row of the ``rewards`` table."""
        return {"trajectory_id": self.trajectory_id, "group_id": self.group_id, "value": self.reward,
                "metrics": self.metrics, "source": self.source, "explanation": self.explanation,
                "created_at": self.created_at, "call_id": self.call_id}  # fmt: skip


async def add_rewards(
    engine: AsyncEngine,
    rewards: Iterable[RewardIn],
    policies: frozenset[str] | None = None,
    check: Callable[[set[str]], None] | None = None,
    weigh: Callable[[str, dict[str, float]], float] | None = None,
) -> list[RewardRecord]:
    """Record rewards in one transaction; any unknown trajectory id, or call id not of its trajectory, rejects
    the whole batch.

    A service's reward becomes the trajectory's reward unless a person scored it; a person's
    score always does (either ends its threading: a rewarded trajectory takes no more calls by
    continuation). Returns the rewards written. ``policies``: only trajectories of these policies
    may be rewarded; another policy's is unknown (None: every policy). ``check`` is given the
    policies the batch rewards before anything is written; what it raises rejects the whole batch. ``weigh``
    makes the reward of an item that has none of its trajectory's policy and its metrics (what it raises rejects
    the whole batch too).
    """
    items = list(rewards)
    wanted = {r.trajectory_id for r in items}
    now = time.time()
    query = select(T.c.id, T.c.group_id, T.c.policy).where(T.c.id.in_(wanted))
    if policies is not None:
        query = query.where(T.c.policy.in_(sorted(policies)))
    async with engine.begin() as conn:
        rows = (await conn.execute(query)).all()
        group_of = {row[0]: row[1] for row in rows}
        policy_of = {row[0]: str(row[2]) for row in rows}
        if missing := wanted - group_of.keys():
            raise UnknownTrajectories(list(missing))
        if calls := {r.call_id: r.trajectory_id for r in items if r.call_id is not None}:
            query = select(C.c.id, C.c.trajectory_id).where(C.c.id.in_(sorted(calls)))
            found = {str(row[0]): str(row[1]) for row in (await conn.execute(query)).all()}
            if wrong := [c for c, trajectory in calls.items() if found.get(c) != trajectory]:
                raise UnknownCalls(wrong)
        if check is not None:
            check({str(row[2]) for row in rows})
        if any(r.reward is None for r in items):
            if weigh is None:
                raise ValueError("a reward without a value needs weigh")
            items = [
                r if r.reward is not None else replace(r, reward=weigh(policy_of[r.trajectory_id], r.metrics))
                for r in items
            ]
        created = [
            RewardRecord(r.trajectory_id, group_of[r.trajectory_id], float(r.reward or 0.0), r.metrics, r.source,
                         r.explanation, now, r.call_id)
            for r in items
        ]  # fmt: skip
        await conn.execute(insert(R), [reward.row() for reward in created])
        if of_calls := sorted((r for r in items if r.call_id is not None), key=lambda r: str(r.call_id)):
            await conn.execute(
                update(C).where(C.c.id == bindparam("b_id")).values(reward=bindparam("b_r")),
                [{"b_id": r.call_id, "b_r": r.reward} for r in of_calls],
            )
        # A service's reward and its metrics, unless a person scored the trajectory; a person's score over any.
        for source, where in (("service", not_by_a_person()), ("human", T.c.id.is_not(None))):
            if items_of := [r for r in items if r.source == source and r.call_id is None]:
                values = {"reward": bindparam("b_r"), "reward_source": source, "reward_note": bindparam("b_note"),
                          "rewarded_at": now, "tail_hash": None}  # fmt: skip
                if source == "service":
                    values["metrics"] = bindparam("b_m")
                else:  # a person's score brings their demonstration, or none: a second score replaces the first
                    values["demonstration"] = bindparam("b_demo")
                await conn.execute(
                    update(T).where(T.c.id == bindparam("b_id"), where).values(values),
                    # In key order, as every writer of trajectories does (no deadlock between replicas);
                    # the sort is stable, so the later of two rewards for one trajectory still wins.
                    [{"b_id": r.trajectory_id, "b_r": r.reward, "b_m": r.metrics, "b_note": r.explanation,
                      "b_demo": r.demonstration}
                     for r in sorted(items_of, key=lambda r: r.trajectory_id)],
                )  # fmt: skip
    return created
