"""The store of tracetrain 35c4648, the last release without migrations.

That release made its tables with ``SQLModel.metadata.create_all``; this revision makes
the same tables, columns, indexes and unnamed unique constraints, so a database it wrote
is this revision's schema exactly: ``store._migrate`` stamps such a database 0001_35c4648
and upgrades it from here. ``tests/data/schema_35c4648.*.sql`` hold that release's DDL,
and tests/test_migrations.py checks the two agree.

Revision ID: 0001_35c4648
Revises:
Create Date: 2026-11-22 (the release it reproduces)
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_35c4648"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("pk", sa.Integer(), nullable=False),
        sa.Column("policy", sa.String(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=True),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("error", sa.String(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("published_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("pk"),
        sa.UniqueConstraint("policy", "version"),
    )
    op.create_index("ix_adapters_policy", "adapters", ["policy"])

    op.create_table(
        "calls",
        sa.Column("pk", sa.Integer(), nullable=False),
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("trajectory_id", sa.String(), nullable=False),
        sa.Column("group_id", sa.String(), nullable=False),
        sa.Column("policy", sa.String(), nullable=False),
        sa.Column("endpoint", sa.String(), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("served_model", sa.String(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("request", sa.JSON(), nullable=True),
        sa.Column("response", sa.JSON(), nullable=True),
        sa.Column("prompt_token_ids", sa.JSON(), nullable=True),
        sa.Column("completion_token_ids", sa.JSON(), nullable=True),
        sa.Column("logprobs", sa.JSON(), nullable=True),
        sa.Column("other_choices", sa.JSON(), nullable=True),
        sa.Column("finish_reason", sa.String(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.Column("error", sa.String(), nullable=True),
        sa.Column("latency_ms", sa.Float(), nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("pk"),
        sa.UniqueConstraint("id"),
    )
    op.create_index("ix_calls_trajectory_started", "calls", ["trajectory_id", "started_at"])

    op.create_table(
        "groups",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("policy", sa.String(), nullable=False),
        sa.Column("task_key", sa.String(), nullable=True),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_groups_policy", "groups", ["policy"])
    op.create_index("ix_groups_state", "groups", ["state"])
    op.create_index("ix_groups_task_key", "groups", ["task_key"])

    op.create_table(
        "judgements",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("group_id", sa.String(), nullable=False),
        sa.Column("policy", sa.String(), nullable=False),
        sa.Column("reward_source", sa.String(), nullable=False),
        sa.Column("trigger", sa.String(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("cache_key", sa.String(), nullable=False),
        sa.Column("cached", sa.Boolean(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("n_trajectories", sa.Integer(), nullable=False),
        sa.Column("scores", sa.JSON(), nullable=True),
        sa.Column("error", sa.String(), nullable=True),
        sa.Column("usage", sa.JSON(), nullable=True),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_judgements_cache_key", "judgements", ["cache_key"])
    op.create_index("ix_judgements_group_id", "judgements", ["group_id"])
    op.create_index("ix_judgements_policy", "judgements", ["policy"])
    op.create_index("ix_judgements_state", "judgements", ["state"])

    op.create_table(
        "policies",
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("base_model", sa.String(), nullable=False),
        sa.Column("active_version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )

    op.create_table(
        "rewards",
        sa.Column("pk", sa.Integer(), nullable=False),
        sa.Column("trajectory_id", sa.String(), nullable=False),
        sa.Column("group_id", sa.String(), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.Column("source", sa.String(), nullable=False),
        sa.Column("explanation", sa.String(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("pk"),
    )
    op.create_index("ix_rewards_trajectory_id", "rewards", ["trajectory_id"])

    op.create_table(
        "training_jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("policy", sa.String(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("group_ids", sa.JSON(), nullable=True),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.Column("progress", sa.Float(), nullable=False),
        sa.Column("error", sa.String(), nullable=True),
        sa.Column("worker", sa.String(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_training_jobs_policy", "training_jobs", ["policy"])
    op.create_index("ix_training_jobs_state", "training_jobs", ["state"])

    op.create_table(
        "trajectories",
        sa.Column("pk", sa.Integer(), nullable=False),
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("group_id", sa.String(), nullable=False),
        sa.Column("policy", sa.String(), nullable=False),
        sa.Column("keyed_by", sa.String(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("n_calls", sa.Integer(), nullable=False),
        sa.Column("last_version", sa.Integer(), nullable=False),
        sa.Column("tail_hash", sa.String(), nullable=True),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("reward_source", sa.String(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.Column("rewarded_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("pk"),
        sa.UniqueConstraint("id"),
    )
    op.create_index("ix_trajectories_created_at", "trajectories", ["created_at"])
    op.create_index("ix_trajectories_group_id", "trajectories", ["group_id"])
    op.create_index("ix_trajectories_policy", "trajectories", ["policy"])
    op.create_index("ix_trajectories_tail_hash", "trajectories", ["tail_hash"])


def downgrade() -> None:
    for table in (
        "trajectories",
        "training_jobs",
        "rewards",
        "policies",
        "judgements",
        "groups",
        "calls",
        "adapters",
    ):
        op.drop_table(table)  # its indexes go with it
