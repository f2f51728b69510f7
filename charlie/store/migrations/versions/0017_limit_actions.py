"""an operator's actions on a provider limit: limit_actions (a pause lifted, I27, I32)

A new table only: older code never reads it.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "limit_actions",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("limit_key", sa.String(500), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("note", sa.Text(), nullable=True),
        sa.Column(
            "detail", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=True
        ),
        sa.Column("channel", sa.String(16), nullable=False),
        sa.Column("authenticated", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    op.create_index("ix_limit_actions_key", "limit_actions", ["limit_key", "id"])


def downgrade() -> None:
    op.drop_index("ix_limit_actions_key", "limit_actions")
    op.drop_table("limit_actions")
