"""tool calls record which implementation they were started with

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A nullable column without a default: on PostgreSQL a catalog change only, no table
    # rewrite and no long lock on a large tool_calls table. Calls started before it have NULL,
    # which any worker with a tool of the call's name may resume, as before.
    op.add_column("tool_calls", sa.Column("implementation", sa.String(300), nullable=True))


def downgrade() -> None:
    op.drop_column("tool_calls", "implementation")
