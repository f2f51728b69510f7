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
from sqlalchemy import Engine, Index, MetaData, text
from sqlalchemy.engine import make_url

from charlie.store.engine import current_revision, get_engine, head_revision, upgrade
from charlie.store.schema import Base
from tests.conftest import BACKEND, BACKEND_PROBLEM
from tests.support.cluster import recreate_postgres_database
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


def test_the_concurrent_index_migrations_run_again_after_an_interrupted_build(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """0015, 0016 and 0018 build (and 0018 drops) indexes CONCURRENTLY: an interrupted build
    or drop leaves an INVALID index of the name (PostgreSQL), and an interruption between two
    steps leaves the first one done with the revision not recorded. `charlie db upgrade` run
    again drops the invalid one and builds it, takes the valid one as it is, drops what is
    still to drop, and ends with every index valid and the schema the code declares."""
    if BACKEND_PROBLEM:
        pytest.skip(BACKEND_PROBLEM)
    postgres = (BACKEND.database_url or "").startswith("postgresql")
    if postgres:
        url = make_url(BACKEND.database_url or "")
        url = url.set(database=f"{url.database}_rerun").render_as_string(hide_password=False)
        recreate_postgres_database(url)
    else:
        url = f"sqlite:///{tmp_path_factory.mktemp('rerun') / 'charlie.db'}"
    upgrade(url, "0014")
    engine = get_engine(url)
    try:
        with engine.begin() as conn:
            # 0015's first build interrupted: its index left behind, INVALID on PostgreSQL
            conn.execute(
                text(
                    "CREATE INDEX ix_executions_live_updated ON executions (updated_at) "
                    "WHERE phase <> 'done'"
                )
            )
            # 0016's second build finished, the run stopped before the revision was recorded
            conn.execute(
                text(
                    "CREATE INDEX ix_tool_calls_in_flight ON tool_calls (queued_at) "
                    "WHERE state <> 'settled' AND hold IS NULL"
                )
            )
            # 0018 stopped midway: one of its builds done, one of its drops done, and one
            # drop interrupted (DROP INDEX CONCURRENTLY leaves the index INVALID)
            conn.execute(
                text(
                    "CREATE INDEX ix_tool_calls_handle_set ON tool_calls (handle) "
                    "WHERE handle IS NOT NULL"
                )
            )
            conn.execute(text("DROP INDEX ix_tasks_status"))
            if postgres:
                for name in ("ix_executions_live_updated", "ix_tool_calls_handle"):
                    conn.execute(
                        text(
                            "UPDATE pg_index SET indisvalid = false "
                            f"WHERE indexrelid = '{name}'::regclass"
                        )
                    )
        upgrade(url)
        assert current_revision(url) == head_revision()
        if postgres:
            with engine.connect() as conn:
                invalid = conn.execute(
                    text(
                        "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                        "WHERE NOT i.indisvalid"
                    )
                ).all()
            assert invalid == []
        assert _differences(engine, Base.metadata) == []
    finally:
        engine.dispose()


def test_the_indexes_are_the_ones_the_code_declares_to_their_predicates(migrated: Engine) -> None:
    """The comparison above reads an index's columns, not a partial index's predicate: here
    every index of the migrated database, as PostgreSQL prints it whole, is the one a database
    made from charlie/store/schema.py has (a predicate the scans say as a literal, and the
    migration built otherwise, would leave a scan reading the whole table)."""
    if migrated.dialect.name != "postgresql":
        pytest.skip("PostgreSQL prints an index's predicate normalized; SQLite keeps its text")
    declared_url = migrated.url.set(database=f"{migrated.url.database}_declared")
    rendered = declared_url.render_as_string(hide_password=False)
    recreate_postgres_database(rendered)
    declared = get_engine(rendered)
    try:
        Base.metadata.create_all(declared)

        def indexes(engine: Engine) -> dict[str, str]:
            with engine.connect() as conn:
                rows = conn.execute(
                    text(
                        "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = "
                        "current_schema() AND tablename <> 'alembic_version'"
                    )
                ).all()
            return {str(name): str(definition) for name, definition in rows}

        assert indexes(migrated) == indexes(declared)
    finally:
        declared.dispose()
