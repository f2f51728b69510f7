"""index the runs in motion and the calls in flight; a wake-up for each settled turn

The sweeps' scans for stalled runs and for lost or abandoned calls read, since 0015, the live
rows: every run not done, every call not settled. Runs and calls waiting for people (an
approval, a question, a verdict) are live too, for hours, and there may be tens of thousands
of them: each round read them all to skip them. Two partial indexes hold only what those scans
act on:

- ``ix_executions_moving_updated``: runs neither done nor in await_tools. A run in await_tools
  waits for its calls; the settle that completes its turn now stores a wake-up a stall period
  ahead, so a lost await tick is found by the wake scan (``ix_executions_wake_at``) rather than
  by probing each waiting run's calls.
- ``ix_tool_calls_in_flight``: calls not settled and held for no person. A held call cannot
  outlive its run (the ending transition settles it), nor be lost on its way to a worker.

Both are built ``CONCURRENTLY`` on PostgreSQL (no table lock; writes go on). Then each run
already in await_tools with every call of its turn settled and no wake-up before now (a settle
by the previous release, whose await tick is still on its way or was lost) gets a wake-up now,
so the next sweep moves it if nothing else has. (After this, the stalled-run sweep probes the
runs in await_tools for such a turn only every CHARLIE_SWEEP_PROBE_SECONDS.)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-05
"""

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

from charlie.store.index_builds import create_index_concurrently

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

#: (name, table, columns, predicate): the predicates are those of charlie/store/schema.py
#: (MOVING_RUN_WHERE, IN_FLIGHT_CALL_WHERE), said as literals by the scans that use them.
INDEXES = (
    (
        "ix_executions_moving_updated",
        "executions",
        ["updated_at"],
        "phase <> 'done' AND phase <> 'await_tools'",
    ),
    ("ix_tool_calls_in_flight", "tool_calls", ["queued_at"], "state <> 'settled' AND hold IS NULL"),
)

_runs = sa.table(
    "executions",
    sa.column("id", sa.String),
    sa.column("turn", sa.Integer),
    sa.column("phase", sa.String),
    sa.column("wake_at", sa.DateTime(timezone=True)),
)
_calls = sa.table(
    "tool_calls",
    sa.column("execution_id", sa.String),
    sa.column("turn", sa.Integer),
    sa.column("state", sa.String),
)


def upgrade() -> None:
    with op.get_context().autocommit_block():
        # (again after an interrupted build: charlie/store/index_builds.py)
        for name, table, columns, where in INDEXES:
            create_index_concurrently(name, table, columns, where)
    open_call = (
        sa.select(sa.literal(1))
        .where(
            _calls.c.execution_id == _runs.c.id,
            _calls.c.turn == _runs.c.turn,
            _calls.c.state != "settled",
        )
        .exists()
    )
    # The timestamp as the application writes it (SQLite keeps datetimes as text).
    now = datetime.now(UTC)
    if op.get_bind().dialect.name == "sqlite":
        now = now.replace(tzinfo=None)
    op.execute(
        _runs.update()
        .where(
            _runs.c.phase == "await_tools",
            # none, or a later one (an earlier wait's deadline) that would find it only then
            sa.or_(_runs.c.wake_at.is_(None), _runs.c.wake_at > now),
            ~open_call,
        )
        .values(wake_at=now)
    )


def downgrade() -> None:
    with op.get_context().autocommit_block():
        for name, table, _, _ in INDEXES:
            op.drop_index(name, table_name=table, postgresql_concurrently=True)
