"""One training step of a policy at a time: a partial unique index on the running jobs.

Two trainer workers of one policy each claimed a queued job and trained from the same version,
and both picked the same next version (the newest adapter's + 1). ``ux_training_jobs_running``
holds at most one ``running`` job per policy, so of workers claiming together one wins (the
others' claim fails on the index and they wait), and the claim writes the version its step will
record into the job's ``version``. Before the index is made, running jobs beyond the oldest of
each policy are queued again (their workers' results are then refused, as for a lost lease).

Revision ID: 0007_one_running_job
Revises: 0006_replicas
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_one_running_job"
down_revision = "0006_replicas"
branch_labels = None
depends_on = None

_RUNNING = sa.text("state = 'running'")
_REQUEUE_EXTRA = """
UPDATE training_jobs SET state = 'queued', worker = NULL, started_at = NULL, progress = 0.0,
    lease_expires_at = NULL, reclaimed = reclaimed + 1
WHERE state = 'running' AND id NOT IN (SELECT min(id) FROM training_jobs WHERE state = 'running' GROUP BY policy)
"""


def upgrade() -> None:
    op.execute(_REQUEUE_EXTRA)
    op.create_index(
        "ux_training_jobs_running", "training_jobs", ["policy"], unique=True,
        sqlite_where=_RUNNING, postgresql_where=_RUNNING,
    )  # fmt: skip


def downgrade() -> None:
    op.drop_index("ux_training_jobs_running", table_name="training_jobs")
