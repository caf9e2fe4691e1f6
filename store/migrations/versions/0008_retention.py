"""Compact capture: a call may store only what it adds to an earlier call of its trajectory.

``calls.prefix_of`` names the earlier call (its ``id``); ``prefix_tokens`` is how many of that
call's prompt + completion ids begin this call's prompt, ``prefix_messages`` how many of its
request's messages begin this one's (``store._compact``). Existing rows keep NULL and 0: they
are whole and read as before. Adapters gain no column: a version whose files retention deleted
is in the state ``pruned`` (``store.AdapterState``), a value of the existing ``state`` column.

Revision ID: 0008_retention
Revises: 0007_one_running_job
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_retention"
down_revision = "0007_one_running_job"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("prefix_of", sa.String(), nullable=True))
        batch.add_column(sa.Column("prefix_tokens", sa.Integer(), nullable=False, server_default=sa.text("0")))
        batch.add_column(sa.Column("prefix_messages", sa.Integer(), nullable=False, server_default=sa.text("0")))


def downgrade() -> None:
    # Compact rows cannot be read without the columns: refuse rather than lose their prompts.
    bind = op.get_bind()
    compact = bind.execute(sa.text("SELECT count(*) FROM calls WHERE prefix_of IS NOT NULL")).scalar()
    if compact:
        raise RuntimeError(f"{compact} calls are stored compactly; downgrading would lose their prompts")
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("prefix_messages")
        batch.drop_column("prefix_tokens")
        batch.drop_column("prefix_of")
