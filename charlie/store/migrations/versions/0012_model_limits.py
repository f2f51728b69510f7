"""provider limits the fleet keeps: limit_state, limit_slots, limit_waiters; tasks.priority

New tables, and a column with a constant default (on PostgreSQL 11+ a catalog change only, no
rewrite of a large table).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("priority", sa.Integer(), nullable=False, server_default="0"))
    op.create_table(
        "limit_state",
        sa.Column("limit_key", sa.String(500), primary_key=True),
        sa.Column("paused_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("throttles", sa.Integer(), nullable=False, server_default="0"),
    )
    op.create_table(
        "limit_slots",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("limit_key", sa.String(500), nullable=False),
        sa.Column("execution_id", sa.String(128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("taken_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("released_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("tokens", sa.Integer(), nullable=False),
    )
    op.create_index("ix_limit_slots_key_taken", "limit_slots", ["limit_key", "taken_at"])
    op.create_index("ix_limit_slots_execution", "limit_slots", ["execution_id"])
    op.create_table(
        "limit_waiters",
        sa.Column("limit_key", sa.String(500), primary_key=True),
        sa.Column("execution_id", sa.String(128), primary_key=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("since", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("woken_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_limit_waiters_order", "limit_waiters", ["limit_key", "priority", "since"])


def downgrade() -> None:
    op.drop_table("limit_waiters")
    op.drop_index("ix_limit_slots_execution", "limit_slots")
    op.drop_index("ix_limit_slots_key_taken", "limit_slots")
    op.drop_table("limit_slots")
    op.drop_table("limit_state")
    op.drop_column("tasks", "priority")
