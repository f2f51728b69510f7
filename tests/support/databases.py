"""A database of a test module's own, on the session's backend, with no workers on it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import Engine
from sqlalchemy.engine import make_url

from charlie.store.engine import get_engine, upgrade
from tests.conftest import BACKEND, BACKEND_PROBLEM
from tests.support.cluster import recreate_postgres_database


@contextmanager
def own_database(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Engine]:
    """A fresh, migrated database named after ``name`` (PostgreSQL: the session's database
    name + ``_name``; SQLite: a file of its own), so the shared cluster's beat never sweeps its
    rows and its scans see only what the module made. Skips when the backend is unreachable."""
    if BACKEND_PROBLEM:
        pytest.skip(BACKEND_PROBLEM)
    if BACKEND.database_url and BACKEND.database_url.startswith("postgresql"):
        url = make_url(BACKEND.database_url)
        url = url.set(database=f"{url.database}_{name}").render_as_string(hide_password=False)
        recreate_postgres_database(url)
    else:
        url = f"sqlite:///{tmp_path_factory.mktemp(name) / 'charlie.db'}"
    upgrade(url)
    engine = get_engine(url)
    try:
        yield engine
    finally:
        engine.dispose()
