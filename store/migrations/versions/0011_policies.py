"""Several policies on one server: each policy's settings and its life cycle (serving or retired).

``policies.config`` holds the settings a policy overrides (its group size, batch, retention, regression
guard, judge and sampling defaults; ``proxy.PolicyOverrides``): JSON, NULL for none. ``policies.state``
is ``serving`` or ``retired`` (``store.PolicyState``): a retired policy is not served or trained, and its
rows stay readable; ``retired_at`` says since when. An index on (policy, started_at) of training jobs
lets the trainer claim the job of the policy served least recently in one indexed read per policy
(``store.Jobs.claim_next``).

Revision ID: 0011_policies
Revises: 0010_evaluations
Create Date: 2027-01-12
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011_policies"
down_revision = "0010_evaluations"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("policies") as batch:
        batch.add_column(sa.Column("config", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("state", sa.String(), nullable=False, server_default=sa.text("'serving'")))
        batch.add_column(sa.Column("retired_at", sa.Float(), nullable=True))
    op.create_index("ix_training_jobs_policy_started", "training_jobs", ["policy", "started_at"])


def downgrade() -> None:
    op.drop_index("ix_training_jobs_policy_started", table_name="training_jobs")
    with op.batch_alter_table("policies") as batch:
        batch.drop_column("retired_at")
        batch.drop_column("state")
        batch.drop_column("config")
