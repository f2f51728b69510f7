"""operator actions: the channel an action came through and whether its actor was
authenticated (I32)

Before this, an action's ``actor`` was whatever name its caller gave: a broker message could
name the console's operator and read as the console's action. ``channel`` (api, cli, ui,
celery) says how it arrived; ``authenticated`` whether the channel established the name (the
console's token) or the caller only claimed it. Rows recorded before keep a NULL channel and
read as claimed, channel not recorded.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A nullable column and a NOT NULL one with a constant default: on PostgreSQL 11+ catalog
    # changes only, no rewrite of a large table.
    op.add_column("operator_actions", sa.Column("channel", sa.String(16), nullable=True))
    op.add_column(
        "operator_actions",
        sa.Column("authenticated", sa.Boolean(), nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    op.drop_column("operator_actions", "authenticated")
    op.drop_column("operator_actions", "channel")
