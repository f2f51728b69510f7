"""Indexes built by migrations while the tables take writes, so that a migration runs again.

``CREATE INDEX CONCURRENTLY`` (PostgreSQL) that is interrupted (a killed ``charlie db upgrade``,
a lost connection, a deadlock or a unique violation during its build) leaves an INVALID index of
its name behind: never used by a query, still updated by every write, and in the way of the
next attempt ("relation ... already exists"). An index built here is taken as it is when a valid
one of its name exists (the build finished and the interruption came after it), dropped and
built again when only an invalid one does, and built when none does: a migration is as
re-runnable after any interruption as its other statements are. SQLite builds an index in a
transaction (nothing invalid is left), so there the name is checked only.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


def index_validity(name: str) -> bool | None:
    """Whether an index called ``name`` exists in the schema the migration works in: True
    valid, False invalid (an interrupted concurrent build's), None none."""
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        found = bind.execute(
            sa.text("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(:name)"),
            {"name": name},
        ).first()
        return None if found is None else bool(found[0])
    found = bind.execute(
        sa.text("SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = :name"),
        {"name": name},
    ).first()
    return None if found is None else True


def create_index_concurrently(
    name: str, table: str, columns: Sequence[str], where: str | None = None
) -> None:
    """An index (partial, given ``where``) built without blocking writes, in an autocommit
    block (the caller's), that an earlier interrupted attempt does not stop."""
    valid = index_validity(name)
    if valid:
        return
    if valid is False:
        op.drop_index(name, table_name=table, postgresql_concurrently=True)
    op.create_index(
        name,
        table,
        list(columns),
        postgresql_concurrently=True,
        postgresql_where=None if where is None else sa.text(where),
        sqlite_where=None if where is None else sa.text(where),
    )


def drop_index_concurrently(name: str, table: str) -> None:
    """An index dropped without blocking writes, in an autocommit block (the caller's); none
    of its name is already what was asked (an earlier attempt dropped it)."""
    if index_validity(name) is None:
        return
    op.drop_index(name, table_name=table, postgresql_concurrently=True)
