"""What `charlie` says when its infrastructure is wrong: a line or two naming what, where and
what to do, a non-zero exit status, no traceback (``--debug`` shows it). Each command runs as a
person runs it, in a process of its own, against a private home; none needs the session's
database or broker."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from charlie.config import database_url_of

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


def closed_port() -> int:
    """A port nothing listens on: connecting to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("CHARLIE_")}
    full.update({"CHARLIE_HOME": str(home), "PYTHONPATH": str(REPO), **env})
    return subprocess.run(
        [sys.executable, "-m", "charlie", *args],
        env=full,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_short(done: subprocess.CompletedProcess[str], *, lines: int = 2) -> str:
    err = done.stderr.strip()
    assert "Traceback" not in err, err
    assert 1 <= len(err.splitlines()) <= lines, err
    return err


def test_a_database_that_refuses_connections_is_one_line(tmp_path: Path) -> None:
    # postgres:// (what most hosts hand out) is PostgreSQL's URL like postgresql://
    url = f"postgres://someone:s3cret@127.0.0.1:{closed_port()}/charlie"
    for args in (("list",), ("submit", "hi", "--model", "scripted:x.json")):
        done = run(tmp_path, *args, CHARLIE_DATABASE_URL=url)
        assert done.returncode == 2, done
        err = assert_short(done)
        assert err.startswith("charlie: cannot reach the database postgresql://someone:***@"), err
        assert "s3cret" not in err and "CHARLIE_DATABASE_URL" in err, err
    debug = run(tmp_path, "--debug", "list", CHARLIE_DATABASE_URL=url)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_a_dead_broker_saves_the_task_and_says_so_in_two_lines(tmp_path: Path) -> None:
    script = tmp_path / "turns.json"
    script.write_text(json.dumps([{"say": "hi"}]))
    broker = f"redis://127.0.0.1:{closed_port()}/0"
    done = run(tmp_path, "submit", "hi", "--model", f"scripted:{script}", CHARLIE_BROKER_URL=broker)
    assert done.returncode == 0, done  # saved: the beat's sweep starts it when the broker is back
    task_id = done.stdout.strip()
    err = assert_short(done, lines=3)
    assert "could not be published" in err and "sweep will start it" in err, err
    listed = run(tmp_path, "list", "--json", CHARLIE_BROKER_URL=broker)
    assert [t["id"] for t in json.loads(listed.stdout)] == [task_id]


def test_tool_modules_that_cannot_be_imported_refuse_the_submit(tmp_path: Path) -> None:
    script = tmp_path / "turns.json"
    script.write_text(json.dumps([{"say": "hi"}]))
    modules = {"CHARLIE_TOOL_MODULES": "no_such_tools_module"}
    done = run(tmp_path, "submit", "hi", "--model", f"scripted:{script}", **modules)
    assert done.returncode == 2, done
    err = assert_short(done)
    assert "CHARLIE_TOOL_MODULES names 'no_such_tools_module'" in err, err
    listed = run(tmp_path, "list", "--json")
    assert json.loads(listed.stdout) == []  # nothing was accepted


def test_db_upgrade_says_from_and_to_or_that_nothing_was_needed(tmp_path: Path) -> None:
    from charlie.store.engine import head_revision

    head = head_revision()
    first = run(tmp_path, "db", "upgrade")
    assert first.returncode == 0, first.stderr
    assert f"upgraded from revision (empty database) to {head}" in first.stdout, first.stdout
    again = run(tmp_path, "db", "upgrade")
    assert again.returncode == 0, again.stderr
    assert f"already at revision {head}; nothing to do" in again.stdout, again.stdout


def test_postgres_urls_read_as_postgresql() -> None:
    assert database_url_of("postgres://u:p@h:5432/d") == "postgresql://u:p@h:5432/d"
    assert database_url_of("postgres+psycopg://h/d") == "postgresql+psycopg://h/d"
    assert database_url_of(" sqlite:///x.db ") == "sqlite:///x.db"
