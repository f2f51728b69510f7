"""fewer index entries a turn writes: partial indexes for the scans, covered ones dropped

A steady turn inserts a tool call and settles it, and moves its run twice; none of those
updates is HOT (each changes an indexed column), so every index of the row takes a new entry
at every write, whether or not any scan would ever find the row through it. Of the tool
calls' eight indexes, four held every row for scans that look for a few:

- ``(state, lease_until)``, for the started calls whose lease lapsed (the orphan scan): now
  ``(lease_until) WHERE state = 'started'``, so the settled version of a call adds nothing;
- ``(state, deadline_at)``, for the open calls past their deadline: the partial index of 0015
  (``ix_tool_calls_open_deadline``) already holds exactly those, and the scan reads it;
- ``(handle)``, for the waits on a task: now ``WHERE handle IS NOT NULL`` (a call with no
  outside work has no handle, and ``handle = $1`` proves the predicate);
- ``(outcome, settled_at)``, for the waits settled past their deadline that the late watch
  observes: now ``(settled_at) WHERE outcome = 'deadline_exceeded'``.

A run's ``wake_at`` is indexed only where it is set (a turn in motion has none). The tasks'
``(status)`` and ``(parent_id)`` are the leading columns of ``(status, created_at, id)`` and
``(parent_id, created_at, id)``, which serve every query they served.

What a scan finds is unchanged; each predicate is the literal its scan says
(charlie/store/scans.py, charlie/store/calls.py). The new indexes are built before the old
ones are dropped, both ``CONCURRENTLY`` on PostgreSQL (no lock that blocks writes), and each
step is taken as done when it already is: the migration runs again after an interruption.
Older code reads the same rows through the new indexes.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06
"""

from alembic import op

from charlie.store.index_builds import create_index_concurrently, drop_index_concurrently

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

#: (name, table, columns, predicate): the predicates are charlie/store/schema.py's
#: (STARTED_CALL_WHERE, HANDLE_SET_WHERE, DEADLINE_SETTLED_WHERE, WAKE_SET_WHERE)
CREATED = (
    ("ix_tool_calls_started_lease", "tool_calls", ["lease_until"], "state = 'started'"),
    ("ix_tool_calls_handle_set", "tool_calls", ["handle"], "handle IS NOT NULL"),
    (
        "ix_tool_calls_deadline_settled",
        "tool_calls",
        ["settled_at"],
        "outcome = 'deadline_exceeded'",
    ),
    ("ix_executions_wake_set", "executions", ["wake_at"], "wake_at IS NOT NULL"),
)

#: (name, table, columns): what they replace, and the two covered ones
DROPPED = (
    ("ix_tool_calls_state_lease", "tool_calls", ["state", "lease_until"]),
    ("ix_tool_calls_state_deadline", "tool_calls", ["state", "deadline_at"]),
    ("ix_tool_calls_handle", "tool_calls", ["handle"]),
    ("ix_tool_calls_outcome_settled", "tool_calls", ["outcome", "settled_at"]),
    ("ix_executions_wake_at", "executions", ["wake_at"]),
    ("ix_tasks_status", "tasks", ["status"]),
    ("ix_tasks_parent_id", "tasks", ["parent_id"]),
)


def upgrade() -> None:
    with op.get_context().autocommit_block():
        for name, table, columns, where in CREATED:
            create_index_concurrently(name, table, columns, where)
        for name, table, _ in DROPPED:
            drop_index_concurrently(name, table)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        for name, table, columns in DROPPED:
            create_index_concurrently(name, table, columns)
        for name, table, _, _ in CREATED:
            drop_index_concurrently(name, table)
