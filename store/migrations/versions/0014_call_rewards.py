"""A call's reward, and a person's demonstration.

``calls.reward`` holds the reward of one call (``POST /v1/rewards`` with a ``call_id``: the latest wins), and
``rewards.call_id`` names the call a recorded reward was given to (NULL: the whole trajectory). A call's reward
trains through ``--turn-discount`` (``tracetrain_core.call_advantages``). ``trajectories.demonstration`` keeps the
answer a person wrote for the trajectory with their score (``POST /admin/trajectories/{id}/feedback``), which
``tracetrain export`` writes and ``tracetrain sft`` trains on.

Revision ID: 0014_call_rewards
Revises: 0013_structured_outputs
Create Date: 2026-12-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014_call_rewards"
down_revision = "0013_structured_outputs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("reward", sa.Float(), nullable=True))
    with op.batch_alter_table("rewards") as batch:
        batch.add_column(sa.Column("call_id", sa.String(), nullable=True))
    with op.batch_alter_table("trajectories") as batch:
        batch.add_column(sa.Column("demonstration", sa.String(), nullable=True))


def downgrade() -> None:
    # A call's reward has no place in the old schema: its rows would read as the whole trajectory's, so they go.
    op.execute("DELETE FROM rewards WHERE call_id IS NOT NULL")
    with op.batch_alter_table("trajectories") as batch:
        batch.drop_column("demonstration")
    with op.batch_alter_table("rewards") as batch:
        batch.drop_column("call_id")
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("reward")
