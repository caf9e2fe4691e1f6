"""A call's structured-output specification.

``calls.structured_outputs`` holds the grammar vLLM sampled a constrained call under (its
``StructuredOutputsParams`` as JSON, ``tracetrain_core.structured_outputs``): the trainer rebuilds it
and scores that call's tokens under the same mask. NULL for an unconstrained call and every older row.

Revision ID: 0013_structured_outputs
Revises: 0012_trials
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013_structured_outputs"
down_revision = "0012_trials"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A plain ADD COLUMN (SQLite has it too): a batch would copy every captured call.
    op.add_column("calls", sa.Column("structured_outputs", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("structured_outputs")
