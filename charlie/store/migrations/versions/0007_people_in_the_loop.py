"""people in the loop: the mailbox, held calls and the operators' evidence (I22-I27)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

JSONDoc = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    # Nullable columns, and one NOT NULL with a constant default: on PostgreSQL 11+ catalog
    # changes only, no rewrite of a large table.
    op.add_column("tasks", sa.Column("approve", JSONDoc, nullable=True))
    op.add_column(
        "executions", sa.Column("inbox", sa.Integer(), nullable=False, server_default="0")
    )
    op.add_column("tool_calls", sa.Column("hold", sa.String(16), nullable=True))
    op.add_column("tool_calls", sa.Column("hold_info", JSONDoc, nullable=True))
    op.add_column("tool_calls", sa.Column("on_interrupt", sa.String(8), nullable=True))
    op.create_table(
        "messages",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("task_id", sa.String(128), sa.ForeignKey("tasks.id"), nullable=False),
        sa.Column("message_id", sa.String(200), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("sent_by", sa.String(200), nullable=False),
        sa.Column("delivered_seq", sa.Integer(), nullable=True),
        sa.Column("delivered_turn", sa.Integer(), nullable=True),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.UniqueConstraint("task_id", "message_id", name="uq_message_id"),
    )
    op.create_index("ix_messages_pending", "messages", ["task_id", "delivered_seq", "id"])
    op.create_table(
        "operator_actions",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("task_id", sa.String(128), sa.ForeignKey("tasks.id"), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("call_id", sa.String(200), nullable=True),
        sa.Column("turn", sa.Integer(), nullable=True),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("note", sa.Text(), nullable=True),
        sa.Column("detail", JSONDoc, nullable=True),
        sa.Column("request_id", sa.String(200), nullable=True),
        sa.UniqueConstraint("request_id", name="uq_operator_action_request"),
    )
    op.create_index("ix_operator_actions_task", "operator_actions", ["task_id", "id"])
    op.create_index("ix_operator_actions_call", "operator_actions", ["task_id", "call_id", "turn"])


def downgrade() -> None:
    op.drop_table("operator_actions")
    op.drop_table("messages")
    op.drop_column("tool_calls", "on_interrupt")
    op.drop_column("tool_calls", "hold_info")
    op.drop_column("tool_calls", "hold")
    op.drop_column("executions", "inbox")
    op.drop_column("tasks", "approve")
