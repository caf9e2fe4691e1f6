"""Claims with leases: a training job or an adapter being published has an owner and a lease.

A worker (or proxy replica) that stops renewing its lease loses the claim: the job is queued
again, the adapter goes back to "trained", and ``reclaimed`` counts how often that happened.
Existing rows get no lease and ``reclaimed`` 0; the server default also covers rows an
older tracetrain still inserts while replicas roll over.

Revision ID: 0002_claims
Revises: 0001_35c4648
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_claims"
down_revision = "0001_35c4648"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("training_jobs") as batch:
        batch.add_column(sa.Column("lease_expires_at", sa.Float(), nullable=True))
        batch.add_column(sa.Column("reclaimed", sa.Integer(), nullable=False, server_default=sa.text("0")))
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(sa.Column("lease_owner", sa.String(), nullable=True))
        batch.add_column(sa.Column("lease_expires_at", sa.Float(), nullable=True))
        batch.add_column(sa.Column("reclaimed", sa.Integer(), nullable=False, server_default=sa.text("0")))


def downgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("reclaimed")
        batch.drop_column("lease_expires_at")
        batch.drop_column("lease_owner")
    with op.batch_alter_table("training_jobs") as batch:
        batch.drop_column("reclaimed")
        batch.drop_column("lease_expires_at")
