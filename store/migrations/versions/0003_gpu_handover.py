"""The GPU hand-over: a training job's step on a GPU that vLLM shares (``tracetrain serve --share-gpu``).

The worker asks for the GPU (``gpu_state`` requested), the proxy puts vLLM to sleep and grants
it, the worker releases it once its adapter is recorded, the proxy wakes vLLM (see
``store._lifecycle``). Existing jobs never asked: "none", with no times.

Revision ID: 0003_gpu_handover
Revises: 0002_claims
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_gpu_handover"
down_revision = "0002_claims"
branch_labels = None
depends_on = None

_TIMES = ("gpu_requested_at", "gpu_granted_at", "gpu_released_at", "gpu_asleep_s")


def upgrade() -> None:
    with op.batch_alter_table("training_jobs") as batch:
        batch.add_column(sa.Column("gpu_state", sa.String(), nullable=False, server_default=sa.text("'none'")))
        for name in _TIMES:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("training_jobs") as batch:
        for name in reversed(_TIMES):
            batch.drop_column(name)
        batch.drop_column("gpu_state")
