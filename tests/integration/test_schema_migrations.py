"""Every table, column, index and constraint is declared twice, in charlie/store/schema.py (what
the statements are built against) and in the Alembic migrations (what a database is made of):
after ``upgrade head`` the two agree, on the session's backend (SQLite, or PostgreSQL with
CHARLIE_TEST_DATABASE_URL).

An index declared in one and not the other is a scan the code's author thought was indexed, or
an index a fresh database lacks; a type or nullability that differs is a write refused on one
backend only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, Index, MetaData

from charlie.store.schema import Base
from tests.support.databases import own_database


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with own_database(tmp_path_factory, "schema_migrations") as engine:
        yield engine


def _differences(engine: Engine, metadata: MetaData) -> list[Any]:
    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"compare_type": True, "compare_server_default": True}
        )
        return list(compare_metadata(context, metadata))


def test_the_migrations_make_the_schema_the_code_declares(migrated: Engine) -> None:
    differences = _differences(migrated, Base.metadata)
    assert differences == [], (
        "charlie/store/schema.py and the migrations disagree after `upgrade head` "
        "(add a migration, or correct schema.py):\n" + "\n".join(map(repr, differences))
    )


def test_the_comparison_sees_an_index_one_side_lacks(migrated: Engine) -> None:
    """The comparison above reads indexes: an index only the declared schema has is a
    difference."""
    declared = MetaData()
    for table in Base.metadata.sorted_tables:
        table.to_metadata(declared)
    Index("ix_tasks_only_declared", declared.tables["tasks"].c.model)
    differences = _differences(migrated, declared)
    assert [d[0] for d in differences] == ["add_index"]
    assert differences[0][1].name == "ix_tasks_only_declared"
