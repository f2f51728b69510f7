"""index the live rows the sweeps scan: runs not done, calls not settled

A sweep round asks for runs that are due (lapsed, awake, stalled, stopping) among those not
``done``, and for calls past their deadline or left open by an ended run among those not
``settled``. Finished runs and settled calls are most of a table that only grows; without these
partial indexes PostgreSQL read all of them on every round (a sequential scan: the round's time
grew with the tables, see scripts/bench.py --only growth). Each index holds the live rows only,
so it stays as small as the work in flight.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04
"""

from alembic import op

from charlie.store.index_builds import create_index_concurrently

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

#: (name, table, columns, predicate): the predicates are the literals the sweeps' scans say
#: (charlie/store/scans.py), so that the planner can prove a scan needs only these rows.
INDEXES = (
    ("ix_executions_live_updated", "executions", ["updated_at"], "phase <> 'done'"),
    ("ix_tool_calls_open_deadline", "tool_calls", ["deadline_at"], "state <> 'settled'"),
)


def upgrade() -> None:
    # CONCURRENTLY on PostgreSQL (outside a transaction): the tables keep taking writes while
    # the indexes build.
    with op.get_context().autocommit_block():
        # (again after an interrupted build: charlie/store/index_builds.py)
        for name, table, columns, where in INDEXES:
            create_index_concurrently(name, table, columns, where)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        for name, table, _, _ in INDEXES:
            op.drop_index(name, table_name=table, postgresql_concurrently=True)
