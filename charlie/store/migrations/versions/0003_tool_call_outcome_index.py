"""index tool calls by outcome and settle time, so the late watch finds overdue waits cheaply

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # CONCURRENTLY on PostgreSQL (outside a transaction), so a large tool_calls table keeps
    # taking writes while the index builds.
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_tool_calls_outcome_settled",
            "tool_calls",
            ["outcome", "settled_at"],
            unique=False,
            postgresql_concurrently=True,
        )


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.drop_index(
            "ix_tool_calls_outcome_settled", table_name="tool_calls", postgresql_concurrently=True
        )
