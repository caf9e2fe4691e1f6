"""Adapter files in the store: vLLM fetches an adapter through the proxy, not from the trainer's disk.

The worker writes the files of each adapter it records (``adapter_files``, one row a file, in
the transaction that records the adapter); the proxy serves them to vLLM's tracetrain
resolver. Adapters recorded before this revision have no rows: they are served from disk.

Revision ID: 0004_adapter_files
Revises: 0003_gpu_handover
Create Date: 2026-12-09
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_adapter_files"
down_revision = "0003_gpu_handover"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "adapter_files",
        sa.Column("pk", sa.Integer(), primary_key=True),
        sa.Column("policy", sa.String(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.UniqueConstraint("policy", "version", "name"),
    )


def downgrade() -> None:
    op.drop_table("adapter_files")
