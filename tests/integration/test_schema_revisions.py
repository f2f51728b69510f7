"""How a process's code fits the database's schema (rolling upgrades, charlie.store.revisions):
the same revision runs; an older schema waits for `charlie db upgrade`; a newer one runs unless
its floor is newer than the code; an unmigrated one waits."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, text

from charlie.store.engine import SchemaMissing, _migrated, ensure_schema
from charlie.store.revisions import SchemaFit, check_schema, code_revisions
from tests.support.databases import own_database


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with own_database(tmp_path_factory, "revisions") as made:
        yield made


def _set(engine: Engine, revision: str | None, floor: str | None) -> None:
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = :r"), {"r": revision})
        conn.execute(text("DELETE FROM schema_floor"))
        if floor is not None:
            conn.execute(
                text("INSERT INTO schema_floor (id, revision) VALUES (1, :f)"), {"f": floor}
            )


def _fit(engine: Engine) -> SchemaFit:
    with engine.connect() as conn:
        return check_schema(conn).fit


def test_each_fit_of_code_and_schema(engine: Engine) -> None:
    head, previous = code_revisions()[:2]
    try:
        _set(engine, head, None)
        assert _fit(engine) is SchemaFit.CURRENT
        # the database behind the code: the code's columns may be missing
        _set(engine, previous, None)
        with engine.connect() as conn:
            check = check_schema(conn)
        assert check.fit is SchemaFit.DATABASE_BEHIND and not check.can_claim
        assert "charlie db upgrade" in check.why and previous in check.why
        # a newer schema (a revision this code does not know) that only added: still works
        _set(engine, "9999", None)
        assert _fit(engine) is SchemaFit.NEWER_COMPATIBLE
        _set(engine, "9999", head)
        assert _fit(engine) is SchemaFit.NEWER_COMPATIBLE
        # a newer schema whose floor this code does not reach
        _set(engine, "9999", "9998")
        with engine.connect() as conn:
            check = check_schema(conn)
        assert check.fit is SchemaFit.CODE_TOO_OLD and not check.can_claim
        assert "9998" in check.why and head in check.why
    finally:
        _set(engine, head, None)


def test_a_producer_starts_on_a_newer_compatible_schema_and_not_on_an_older_one(
    engine: Engine,
) -> None:
    url = engine.url.render_as_string(hide_password=False)
    head, previous = code_revisions()[:2]
    try:
        _set(engine, "9999", None)
        _migrated.discard(url)
        ensure_schema(url, auto_upgrade=False)  # runs: the schema still fits this code
        for revision, floor in ((previous, None), ("9999", "9998")):
            _set(engine, revision, floor)
            _migrated.discard(url)
            with pytest.raises(SchemaMissing, match="does not fit this code"):
                ensure_schema(url, auto_upgrade=False)
    finally:
        _set(engine, head, None)
        _migrated.discard(url)
