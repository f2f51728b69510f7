"""telemetry: a task's budget and its trace context

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

JSONDoc = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    # Nullable columns: on PostgreSQL catalog changes only, no rewrite of a large table.
    # budget: {"tokens": N, "usd": X, "model_calls": K}, checked at every turn boundary.
    op.add_column("tasks", sa.Column("budget", JSONDoc, nullable=True))
    # trace: {"traceparent": ..., "tracestate": ...}, so every tick on any worker, after any
    # crash, continues the task's one trace.
    op.add_column("tasks", sa.Column("trace", JSONDoc, nullable=True))


def downgrade() -> None:
    op.drop_column("tasks", "trace")
    op.drop_column("tasks", "budget")
