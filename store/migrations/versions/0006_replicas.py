"""Several proxy replicas on one store: derived groups fill seat by seat, and the judge claims a group.

``groups.task_seq`` numbers the groups derived from one task (1, 2, ...); a unique index on
(policy, task_key, task_seq) lets exactly one replica open the next group of a task when the
newest is full. ``groups.seats`` counts the trajectories keying placed in the group, taken one
by one with a guarded ``UPDATE ... WHERE seats < group_size``, so replicas never overfill a group.
``judge_owner`` and ``judge_lease_expires_at`` are the judge's claim on a group: one replica
judges it at a time. Existing derived groups are numbered by age within their task, and their
seats are their trajectories; client-named groups keep no number (NULLs never collide).

Revision ID: 0006_replicas
Revises: 0005_guard
Create Date: 2026-12-09
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_replicas"
down_revision = "0005_guard"
branch_labels = None
depends_on = None

_SEQ = """
UPDATE groups SET task_seq = (
    SELECT count(*) FROM groups AS older
    WHERE older.policy = groups.policy AND older.task_key = groups.task_key
      AND (older.created_at < groups.created_at OR (older.created_at = groups.created_at AND older.id <= groups.id))
) WHERE task_key IS NOT NULL
"""
_SEATS = "UPDATE groups SET seats = (SELECT count(*) FROM trajectories WHERE trajectories.group_id = groups.id)"


def upgrade() -> None:
    with op.batch_alter_table("groups") as batch:
        batch.add_column(sa.Column("task_seq", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("seats", sa.Integer(), nullable=False, server_default=sa.text("0")))
        batch.add_column(sa.Column("judge_owner", sa.String(), nullable=True))
        batch.add_column(sa.Column("judge_lease_expires_at", sa.Float(), nullable=True))
    op.execute(_SEQ)
    op.execute(_SEATS)
    op.create_index("ux_groups_task_seq", "groups", ["policy", "task_key", "task_seq"], unique=True)


def downgrade() -> None:
    op.drop_index("ux_groups_task_seq", table_name="groups")
    with op.batch_alter_table("groups") as batch:
        batch.drop_column("judge_lease_expires_at")
        batch.drop_column("judge_owner")
        batch.drop_column("seats")
        batch.drop_column("task_seq")
