"""index tool calls by handle, so a finishing child finds the waits observing it

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_tool_calls_handle", "tool_calls", ["handle"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_tool_calls_handle", table_name="tool_calls")
