"""index tasks newest first, by status and by parent, for list_tasks

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

#: (name, columns): each serves one filter of list_tasks in (created_at, id) order, the keyset
#: its pages continue from.
INDEXES = (
    ("ix_tasks_created", ["created_at", "id"]),
    ("ix_tasks_status_created", ["status", "created_at", "id"]),
    ("ix_tasks_parent_created", ["parent_id", "created_at", "id"]),
)


def upgrade() -> None:
    # CONCURRENTLY on PostgreSQL (outside a transaction), so a large tasks table keeps taking
    # writes while the indexes build.
    with op.get_context().autocommit_block():
        for name, columns in INDEXES:
            op.create_index(name, "tasks", columns, postgresql_concurrently=True)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        for name, _ in INDEXES:
            op.drop_index(name, table_name="tasks", postgresql_concurrently=True)
