"""The life cycle of groups, training jobs and adapters: their states and the moves between them.

    group:    open ──job created──▶ training ──step done──▶ trained
                │        ▲                 └────step failed──▶ failed
                │        └──its queued job cancelled (the regression guard paused training)
                └──no reward within --reward-timeout──▶ unrewarded   (never trained)
    job:      queued ──claimed──▶ running ──▶ succeeded | failed
                 ▲ │                 │
                 │ └──cancelled (training paused)──▶ failed
                 └──lease expired────┘          (its worker died: any replica requeues it, once)
    adapter:  trained ──claimed──▶ loading ──▶ published ──▶ retired ──activated──▶ published
                 ▲ │                 │   └───▶ failed ──────activated──────────────▶ published
                 │ └──────────▶ discarded       (trained while paused, or from a version rolled back)
                 └──lease expired────┘          (its proxy died while publishing)
              published ──the regression guard, or its canary trial──▶ rolled_back ──activated by an admin──▶ published
              retired | failed | rolled_back | discarded ──retention deleted its files──▶ pruned   (for good)
    trial:    running ──its rewards, its bound or an admin──▶ promoted | rolled_back
              (a canary trial of a published version on a share of new trajectories: ``store._trials``;
              one running trial per policy, held by a unique index)
    training: active ──the regression guard rolled a version back──▶ paused ──an admin resumes──▶ active
              (a policy's ``training`` column: paused, no job is created and no adapter published)
    policy:   serving ──an admin retires it──▶ retired ──added again──▶ serving
              (a policy's ``state`` column: retired, it is neither served nor trained; its rows stay readable)
    gpu:      none ──asked──▶ requested ──vLLM asleep──▶ granted ──adapter recorded──▶ released
                                  └──────────┬──────────────┘
                                             ▼
                                          revoked      (its worker died, or the step outlived --handover-timeout)
              released | revoked ──the job runs again──▶ requested
              (a running job's hand-over of the GPU it shares with vLLM: column ``gpu_state``, see ``store._jobs``)

``MOVES`` is the whole table. The enums are ``StrEnum``s, so a move is its pair of values:
two kinds of row must not share a pair of state names with different meanings.
``move`` is the only way a state changes: one
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
    UNREWARDED = "unrewarded"  # closed by --reward-timeout with rewards missing: never trained


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
    ROLLED_BACK = "rolled_back"  # served worse than the version before it (proxy.training._guard)
    DISCARDED = "discarded"  # never published: trained while paused, from a version rolled back, or passed over
    # by a newer version while a canary trial ran (store._trials)
    PRUNED = "pruned"  # its files were deleted by retention (store.Adapters.prune); its row and metrics stay


class TrainingState(enum.StrEnum):
    """Whether a policy trains: ``policies.training``. The regression guard pauses it; an admin resumes it."""

    ACTIVE = "active"
    PAUSED = "paused"


class PolicyState(enum.StrEnum):
    """Whether a policy is served: ``policies.state``. An admin retires it; adding it again serves it again."""

    SERVING = "serving"
    RETIRED = "retired"


class TrialState(enum.StrEnum):
    """A canary trial (``trials.state``): a new version serves a share of new trajectories until it is decided."""

    RUNNING = "running"
    PROMOTED = "promoted"  # it serves everything now
    ROLLED_BACK = "rolled_back"  # it serves nothing; training goes on from the version it was tried against


class GpuHandover(enum.StrEnum):
    """Where a running job stands with the one GPU it shares with vLLM (``tracetrain serve --share-gpu``)."""

    NONE = "none"  # never asked (a dedicated GPU, or not at its step yet)
    REQUESTED = "requested"  # the worker waits; the proxy is putting vLLM to sleep
    GRANTED = "granted"  # vLLM sleeps; the worker steps
    RELEASED = "released"  # the worker recorded its adapter; the proxy wakes vLLM
    REVOKED = "revoked"  # ended by the proxy: the worker died, or the step took too long


State = GroupState | JobState | AdapterState | GpuHandover | TrainingState | PolicyState | TrialState

MOVES: frozenset[tuple[State, State]] = frozenset(
    {
        (GroupState.OPEN, GroupState.TRAINING),
        (GroupState.TRAINING, GroupState.TRAINED),
        (GroupState.TRAINING, GroupState.FAILED),
        (GroupState.TRAINING, GroupState.OPEN),  # its queued job was cancelled: training paused
        (GroupState.OPEN, GroupState.UNREWARDED),  # --reward-timeout, with no judge (or the judge failed)
        (JobState.QUEUED, JobState.RUNNING),
        (JobState.RUNNING, JobState.QUEUED),  # lease expired
        (JobState.RUNNING, JobState.SUCCEEDED),
        (JobState.RUNNING, JobState.FAILED),
        (JobState.QUEUED, JobState.FAILED),  # cancelled: the regression guard paused training
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
        (AdapterState.TRAINED, AdapterState.DISCARDED),  # trained while paused, or from a version rolled back
        (AdapterState.PUBLISHED, AdapterState.ROLLED_BACK),  # the regression guard
        (AdapterState.ROLLED_BACK, AdapterState.PUBLISHED),  # an admin activates it anyway
        # Retention: a version neither served nor among those kept loses its files (store.Adapters.prune).
        (AdapterState.RETIRED, AdapterState.PRUNED),
        (AdapterState.FAILED, AdapterState.PRUNED),
        (AdapterState.ROLLED_BACK, AdapterState.PRUNED),
        (AdapterState.DISCARDED, AdapterState.PRUNED),
        (TrialState.RUNNING, TrialState.PROMOTED),
        (TrialState.RUNNING, TrialState.ROLLED_BACK),
        (TrainingState.ACTIVE, TrainingState.PAUSED),
        (TrainingState.PAUSED, TrainingState.ACTIVE),
        (PolicyState.SERVING, PolicyState.RETIRED),
        (PolicyState.RETIRED, PolicyState.SERVING),
        (GpuHandover.NONE, GpuHandover.REQUESTED),
        (GpuHandover.REQUESTED, GpuHandover.GRANTED),
        (GpuHandover.GRANTED, GpuHandover.RELEASED),
        (GpuHandover.REQUESTED, GpuHandover.REVOKED),  # its worker died before the grant
        (GpuHandover.GRANTED, GpuHandover.REVOKED),  # its worker died mid-step, or the step took too long
        # A job queued again (its worker died after asking) asks again when it runs again.
        (GpuHandover.RELEASED, GpuHandover.REQUESTED),
        (GpuHandover.REVOKED, GpuHandover.REQUESTED),
    }
)


def allowed(old: State, new: State) -> bool:
    return (old, new) in MOVES


async def move(
    conn: AsyncConnection,
    table: Table,
    where: Any,
    old: State | tuple[State, ...],
    new: State,
    *,
    column: str = "state",
    **values: Any,
) -> int:
    """Move the rows matching ``where`` from ``old`` to ``new``; returns how many moved.

    ``old`` may be several states (each move must be in the table). Rows in any other
    state are left alone, which is how a race is lost: the caller checks the count.
    ``column`` holds the state (a job's GPU hand-over is ``gpu_state``).
    """
    olds = old if isinstance(old, tuple) else (old,)
    for state in olds:
        if not allowed(state, new):
            raise TransitionRefused(f"{table.name}: {state.value} -> {new.value} is not a move of the life cycle")
    current = table.c[column]
    stmt = update(table).where(where, current.in_([s.value for s in olds])).values({column: new.value, **values})
    return int((await conn.execute(stmt)).rowcount)
