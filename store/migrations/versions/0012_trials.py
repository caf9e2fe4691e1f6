"""Canary trials, and a reward's source and note.

``trials`` holds each canary trial of a policy's new version (``store._trials``): its candidate and
baseline, the share of new trajectories it serves, its state (``store.TrialState``; one running
trial per policy, held by ``ux_trials_running``), the verdict and why. ``trajectories.reward_note``
keeps the note of the reward a trajectory holds (a person's note, or the judge's explanation).

A reward posted by a service was recorded with the source "external"; the sources are now
"service", "judge" and "human" (a person's score): existing rows are renamed.

Revision ID: 0012_trials
Revises: 0011_policies
Create Date: 2026-12-20
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_trials"
down_revision = "0011_policies"
branch_labels = None
depends_on = None

_RUNNING = sa.text("state = 'running'")


def upgrade() -> None:
    op.create_table(
        "trials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("policy", sa.String(), nullable=False),
        sa.Column("candidate", sa.Integer(), nullable=False),
        sa.Column("baseline", sa.Integer(), nullable=False),
        sa.Column("fraction", sa.Float(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.Column("decided_by", sa.String(), nullable=True),
        sa.Column("reason", sa.String(), nullable=True),
        sa.Column("verdict", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_trials_policy", "trials", ["policy"])
    op.create_index(
        "ux_trials_running", "trials", ["policy"], unique=True, sqlite_where=_RUNNING, postgresql_where=_RUNNING
    )
    with op.batch_alter_table("trajectories") as batch:
        batch.add_column(sa.Column("reward_note", sa.String(), nullable=True))
    op.execute("UPDATE rewards SET source = 'service' WHERE source = 'external'")
    op.execute("UPDATE trajectories SET reward_source = 'service' WHERE reward_source = 'external'")


def downgrade() -> None:
    # A person's score is a reward the old schema knows no source for: kept, as a posted one.
    op.execute("UPDATE rewards SET source = 'external' WHERE source IN ('service', 'human')")
    op.execute("UPDATE trajectories SET reward_source = 'external' WHERE reward_source IN ('service', 'human')")
    with op.batch_alter_table("trajectories") as batch:
        batch.drop_column("reward_note")
    op.drop_index("ux_trials_running", table_name="trials")
    op.drop_index("ix_trials_policy", table_name="trials")
    op.drop_table("trials")
