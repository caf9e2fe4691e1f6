"""Evaluations: a version's scores on what it was not trained on, posted by whoever measured them.

The demo posts its held-out success of each version it measured; the trainer worker logs every
evaluation into its run (``--log-to``), at the version's step (``store._evaluations``).

Revision ID: 0010_evaluations
Revises: 0009_front_door
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_evaluations"
down_revision = "0009_front_door"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "evaluations",
        sa.Column("id", sa.Integer(), primary_key=True, nullable=False),
        sa.Column("policy", sa.String(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_evaluations_policy_id", "evaluations", ["policy", "id"])


def downgrade() -> None:
    op.drop_index("ix_evaluations_policy_id", table_name="evaluations")
    op.drop_table("evaluations")
