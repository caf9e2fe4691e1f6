"""The front door: seats without a call found quickly, and dashboard sessions revoked on the server.

``ix_trajectories_unrecorded`` is a partial index on the trajectories that have no call yet (a seat
taken at keying, ``store._derived``): the sweep that gives back the seats of calls never recorded
reads it instead of every trajectory. ``revoked_sessions`` holds the dashboard sessions ended on the
server (a logout, or ``*`` for every session issued before a time; ``store._sessions``).

Revision ID: 0009_front_door
Revises: 0008_retention
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_front_door"
down_revision = "0008_retention"
branch_labels = None
depends_on = None

_UNRECORDED = sa.text("n_calls = 0")


def upgrade() -> None:
    op.create_index(
        "ix_trajectories_unrecorded", "trajectories", ["created_at"], sqlite_where=_UNRECORDED,
        postgresql_where=_UNRECORDED,
    )  # fmt: skip
    op.create_table(
        "revoked_sessions",
        sa.Column("nonce", sa.String(), primary_key=True),
        sa.Column("revoked_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("revoked_sessions")
    op.drop_index("ix_trajectories_unrecorded", table_name="trajectories")
