"""Every migration is online on PostgreSQL (rolling upgrades: `charlie db upgrade` runs while
workers of the previous release keep working).

Each step is applied on its own, from the first, and inspected inside its transaction, on the
tables that existed before it:

- no rewrite: a table's relfilenode is unchanged (ALTER COLUMN TYPE, a volatile default or
  a SET TABLESPACE would give it a new one);
- no scan under a lock that blocks writes: validating a constraint, SET NOT NULL or a
  backfill UPDATE holds its lock for as long as the table is large;
- no lock that blocks writes while an index builds: a ShareLock (CREATE INDEX without
  CONCURRENTLY; build indexes on existing tables with ``postgresql_concurrently=True`` in an
  ``autocommit_block``, as 0003 and 0006 do);
- its lock waits are bounded: lock_timeout is set in its transaction (migrations/env.py).

An ACCESS EXCLUSIVE lock from adding a nullable column or one with a constant default is a
catalog change: held for the rest of the step's transaction, which does nothing slow.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Connection, text
from sqlalchemy.engine import make_url

from charlie.store.alembic_config import alembic_config
from charlie.store.revisions import code_revisions
from tests.conftest import BACKEND, BACKEND_PROBLEM
from tests.support.cluster import recreate_postgres_database

#: Reviewed exceptions, by revision: applied by every deployment long before rolling upgrades
#: were promised. 0002 builds ix_tool_calls_handle without CONCURRENTLY (a ShareLock on
#: tool_calls for the build).
REVIEWED = {"0002": "ShareLock on tool_calls (CREATE INDEX, not CONCURRENTLY)"}

#: the lock a CREATE INDEX without CONCURRENTLY holds on its table while it builds
BUILDS = ("ShareLock",)

#: locks that block writes: brief for a catalog change (adding a column, a foreign key from a
#: new table), as long as the table is large when the statement also scans it (validating a
#: constraint, SET NOT NULL, a backfill). A scan under a weaker lock (CREATE INDEX
#: CONCURRENTLY's, in its own transactions) blocks no write.
WRITE_BLOCKING = ("ShareRowExclusiveLock", "ExclusiveLock", "AccessExclusiveLock")


def _tables(conn: Connection) -> dict[str, int]:
    rows = conn.execute(
        text(
            "SELECT c.relname, c.relfilenode FROM pg_class c JOIN pg_namespace n "
            "ON n.oid = c.relnamespace WHERE n.nspname = current_schema() AND c.relkind = 'r' "
            "AND c.relname <> 'alembic_version'"
        )
    ).all()
    return {name: int(node) for name, node in rows}


@pytest.fixture
def empty_database() -> str:
    if BACKEND_PROBLEM:
        pytest.skip(BACKEND_PROBLEM)
    if not (BACKEND.database_url or "").startswith("postgresql"):
        pytest.skip("the online-migration rules are PostgreSQL's (SQLite rebuilds tables)")
    url = make_url(BACKEND.database_url or "")
    url = url.set(database=f"{url.database}_online")
    rendered = url.render_as_string(hide_password=False)
    recreate_postgres_database(rendered)
    return rendered


def test_every_migration_is_online(empty_database: str) -> None:
    from alembic import command

    problems: list[str] = []
    seen: list[str] = []
    before: dict[str, int] = {}

    def inspect_step(ctx: Any, step: Any, heads: Any, run_args: Any) -> None:
        conn: Connection = ctx.connection
        revision = step.up_revision_id
        seen.append(revision)
        if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
            return  # an autocommit block (CREATE INDEX CONCURRENTLY): nothing held
        found: list[str] = []
        timeout = conn.execute(text("SHOW lock_timeout")).scalar()
        if timeout in (None, "0"):
            found.append("no lock_timeout in its transaction")
        after = _tables(conn)
        for name, node in before.items():
            if after.get(name, node) != node:
                found.append(f"rewrote {name}")
        scanned = set(
            conn.execute(
                text(
                    "SELECT relname FROM pg_stat_xact_user_tables WHERE seq_scan > 0 "
                    "AND relname <> 'alembic_version'"
                )
            ).scalars()
        )
        locks = conn.execute(
            text(
                "SELECT c.relname, l.mode FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                "WHERE l.pid = pg_backend_pid() AND l.granted AND l.locktype = 'relation'"
            )
        ).all()
        for name, mode in locks:
            if name not in before:
                continue
            if mode in BUILDS:
                found.append(f"{mode} on {name}")
            elif mode in WRITE_BLOCKING and name in scanned:
                found.append(f"scanned {name} under {mode}")
        if found and revision not in REVIEWED:
            problems.append(f"{revision}: {', '.join(found)}")

    cfg = alembic_config(empty_database)
    cfg.attributes["connection_url"] = empty_database
    cfg.attributes["on_version_apply"] = inspect_step
    from sqlalchemy import create_engine, pool

    probe = create_engine(empty_database, poolclass=pool.NullPool)
    revisions = list(reversed(code_revisions()))
    try:
        for revision in revisions:
            with probe.connect() as conn:
                before = _tables(conn)
            command.upgrade(cfg, revision)
    finally:
        probe.dispose()
    assert seen == revisions, "every step was inspected"
    assert not problems, "migrations that are not online:\n" + "\n".join(problems)
