"""`charlie` against a server database that was never migrated: one line that says to run
`charlie db upgrade`, exit status 2, no traceback (the embedded SQLite database migrates
itself when a command opens it, so this is PostgreSQL's case)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from tests.conftest import BACKEND, BACKEND_PROBLEM
from tests.support.cluster import recreate_postgres_database
from tests.unit.test_cli_errors import assert_short, run

pytestmark = pytest.mark.timeout(120)


def test_an_unmigrated_database_says_to_upgrade_it(tmp_path: Path) -> None:
    if BACKEND_PROBLEM:
        pytest.skip(BACKEND_PROBLEM)
    if not (BACKEND.database_url and BACKEND.database_url.startswith("postgresql")):
        pytest.skip("the embedded SQLite database migrates itself when a command opens it")
    url = make_url(BACKEND.database_url)
    url = url.set(database=f"{url.database}_unmigrated").render_as_string(hide_password=False)
    recreate_postgres_database(url)  # empty: no Charlie table
    for args in (("list",), ("submit", "hi", "--model", "scripted:x.json")):
        done = run(tmp_path, *args, CHARLIE_DATABASE_URL=url)
        assert done.returncode == 2, done
        err = assert_short(done)
        assert "charlie db upgrade" in err and "_unmigrated" in err, err
