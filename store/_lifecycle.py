"""The life cycle of groups, training jobs and adapters: their states and the moves between them.

    group:    open ──job created──▶ training ──step done──▶ trained
                                        └────step failed──▶ failed
    job:      queued ──claimed──▶ running ──▶ succeeded | failed
                 ▲                   │
                 └──lease expired────┘          (its worker died: any replica requeues it, once)
    adapter:  trained ──claimed──▶ loading ──▶ published ──▶ retired ──activated──▶ published
                 ▲                   │   └───▶ failed ──────activated──────────────▶ published
                 └──lease expired────┘          (its proxy died while publishing)

``MOVES`` is the whole table. ``move`` is the only way a state changes: one
``UPDATE ... WHERE state = :from`` whose row count says whether this process won,
so two replicas racing for the same row can never both succeed. Claims (``running``
jobs, ``loading`` adapters) carry an owner and a lease; whoever finds an expired lease
takes the row back with the same kind of guarded update.
"""

from __future__ import annotations

import enum
from typing import Any

from sqlalchemy import Table, update
from sqlalchemy.ext.asyncio import AsyncConnection

from store._errors import TransitionRefused


class GroupState(enum.StrEnum):
    OPEN = "open"
    TRAINING = "training"
    TRAINED = "trained"
    FAILED = "failed"


class JobState(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class AdapterState(enum.StrEnum):
    TRAINED = "trained"
    LOADING = "loading"
    PUBLISHED = "published"
    FAILED = "failed"
    RETIRED = "retired"


State = GroupState | JobState | AdapterState

MOVES: frozenset[tuple[State, State]] = frozenset(
    {
        (GroupState.OPEN, GroupState.TRAINING),
        (GroupState.TRAINING, GroupState.TRAINED),
        (GroupState.TRAINING, GroupState.FAILED),
        (JobState.QUEUED, JobState.RUNNING),
        (JobState.RUNNING, JobState.QUEUED),  # lease expired
        (JobState.RUNNING, JobState.SUCCEEDED),
        (JobState.RUNNING, JobState.FAILED),
        (JobState.SUCCEEDED, JobState.FAILED),  # its adapter could not be published
        (AdapterState.TRAINED, AdapterState.LOADING),
        (AdapterState.LOADING, AdapterState.TRAINED),  # lease expired
        (AdapterState.LOADING, AdapterState.PUBLISHED),
        (AdapterState.LOADING, AdapterState.FAILED),
        (AdapterState.PUBLISHED, AdapterState.RETIRED),
        # An admin activates a version still on disk (rollback or forward).
        (AdapterState.RETIRED, AdapterState.PUBLISHED),
        (AdapterState.FAILED, AdapterState.PUBLISHED),
        (AdapterState.TRAINED, AdapterState.PUBLISHED),
    }
)


def allowed(old: State, new: State) -> bool:
    return (old, new) in MOVES


async def move(
    conn: AsyncConnection, table: Table, where: Any, old: State | tuple[State, ...], new: State, **values: Any
) -> int:
    """Move the rows matching ``where`` from ``old`` to ``new``; returns how many moved.

    ``old`` may be several states (each move must be in the table). Rows in any other
    state are left alone, which is how a race is lost: the caller checks the count.
    """
    olds = old if isinstance(old, tuple) else (old,)
    for state in olds:
        if not allowed(state, new):
            raise TransitionRefused(f"{table.name}: {state.value} -> {new.value} is not a move of the life cycle")
    stmt = update(table).where(where, table.c.state.in_([s.value for s in olds])).values(state=new.value, **values)
    return int((await conn.execute(stmt)).rowcount)
