"""Never silently worse: the regression guard's pause and verdicts (``proxy.training._guard``).

A policy's ``training`` is "active" or "paused" (``store.TrainingState``): the guard pauses it
when it rolls a version back, with the reason and the times; an admin resumes it. Each
adapter keeps the guard's watch over it (``guard``, JSON: baseline, group means, verdict).
Groups closed by ``--reward-timeout`` take the state "unrewarded", a value, not a column.
Existing policies train ("active"); existing adapters were never watched (NULL).

Revision ID: 0005_guard
Revises: 0004_adapter_files
Create Date: 2026-12-09
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_guard"
down_revision = "0004_adapter_files"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("policies") as batch:
        batch.add_column(sa.Column("training", sa.String(), nullable=False, server_default=sa.text("'active'")))
        batch.add_column(sa.Column("training_reason", sa.String(), nullable=True))
        batch.add_column(sa.Column("paused_at", sa.Float(), nullable=True))
        batch.add_column(sa.Column("rolled_back_at", sa.Float(), nullable=True))
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(sa.Column("guard", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("guard")
    with op.batch_alter_table("policies") as batch:
        batch.drop_column("rolled_back_at")
        batch.drop_column("paused_at")
        batch.drop_column("training_reason")
        batch.drop_column("training")
