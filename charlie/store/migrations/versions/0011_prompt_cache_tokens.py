"""prompt cache tokens: a task's input tokens read from and written to a provider's cache

Both are part of input_tokens, counted on their own so that they are priced at their rates
(CHARLIE_PRICES cache_read / cache_write, charlie.pricing).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A constant default: on PostgreSQL 11+ a catalog change only, no rewrite of a large table.
    for column in ("cache_read_tokens", "cache_write_tokens"):
        op.add_column("tasks", sa.Column(column, sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    op.drop_column("tasks", "cache_write_tokens")
    op.drop_column("tasks", "cache_read_tokens")
