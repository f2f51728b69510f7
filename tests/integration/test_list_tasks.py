"""Listing tasks: newest first, paged by keyset, filtered by status and by
parent, through the Python API and the CLI; each page walks an index, whatever the table's size."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import text, update

import charlie
from charlie import scheduler
from charlie.domain import TaskStatus
from charlie.store.engine import get_engine, upgrade, write
from charlie.store.schema import tasks
from tests.integration.test_production_path import charlie_cli
from tests.support.cluster import Cluster


def _submit_at(engine, prefix: str, at: datetime, parent: str | None = None) -> str:  # type: ignore[no-untyped-def]
    task_id = f"{prefix}-{uuid.uuid4().hex[:8]}"
    scheduler.submit(
        engine,
        prompt="p",
        model="scripted:/x.json",
        tools=None,
        task_id=task_id,
        timeout=None,
        metadata=None,
    )
    with write(engine) as conn:
        conn.execute(
            update(tasks).where(tasks.c.id == task_id).values(created_at=at, parent_id=parent)
        )
    return task_id


@pytest.fixture
def private_engine(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Rows only this test made, in a database no worker sweeps (a producer's view)."""
    url = f"sqlite:///{tmp_path / 'list.db'}"
    upgrade(url)
    return get_engine(url)


def test_newest_first_paged_and_filtered(cluster: Cluster, script) -> None:  # type: ignore[no-untyped-def]
    model, _ = script([{"say": "listed"}])
    mark = uuid.uuid4().hex[:6]
    done = [charlie.submit(f"list {mark} {n}", model=model) for n in range(3)]
    for task_id in done:
        assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED
    newest = charlie.list_tasks(limit=3)
    assert [t.id for t in newest] == done[::-1]
    assert newest[0].status is TaskStatus.SUCCEEDED and newest[0].phase is not None
    # the next page continues after the last one, without repeating it
    first, second = charlie.list_tasks(limit=2), charlie.list_tasks(limit=2, before=done[1])
    assert [t.id for t in first] == [done[2], done[1]]
    assert second[0].id == done[0]
    assert all(t.status is TaskStatus.SUCCEEDED for t in charlie.list_tasks(status="succeeded"))
    assert charlie.list_tasks(status=["failed", "canceled"], limit=1000) is not None
    with pytest.raises(ValueError, match="unknown status 'finished'"):
        charlie.list_tasks(status="finished")
    with pytest.raises(ValueError, match="limit must be a whole number from 1 to 1000"):
        charlie.list_tasks(limit=0)


def test_children_of_a_parent(private_engine) -> None:  # type: ignore[no-untyped-def]
    from charlie.store import reads

    now = datetime.now(UTC)
    parent = _submit_at(private_engine, "parent", now - timedelta(minutes=5))
    kids = [
        _submit_at(private_engine, "kid", now - timedelta(minutes=4 - n), parent) for n in range(3)
    ]
    _submit_at(private_engine, "other", now)
    with private_engine.connect() as conn:
        rows = reads.task_page(conn, statuses=None, parent=parent, limit=10, before=None)
    assert [r.id for r in rows] == kids[::-1]
    # ties on created_at are ordered by id, so no page repeats or skips a task
    same = now + timedelta(minutes=1)
    tied = sorted(_submit_at(private_engine, "tie", same) for _ in range(4))
    with private_engine.connect() as conn:
        page1 = reads.task_page(conn, statuses=None, parent=None, limit=2, before=None)
        page2 = reads.task_page(
            conn, statuses=None, parent=None, limit=2, before=(page1[-1].created_at, page1[-1].id)
        )
    assert [r.id for r in page1 + page2] == tied[::-1]


def test_each_filter_walks_an_index(private_engine) -> None:  # type: ignore[no-untyped-def]
    """No sort of the whole table: SQLite's plan orders by an index (migration 0006)."""
    from sqlalchemy.dialects import sqlite

    from charlie.store import reads

    for statuses, parent in ((None, None), (["running"], None), (None, "p")):
        stmt = reads.task_page_statement(statuses=statuses, parent=parent, limit=50, before=None)
        sql = str(stmt.compile(dialect=sqlite.dialect(), compile_kwargs={"literal_binds": True}))
        with private_engine.connect() as conn:
            plan = " ".join(str(r[-1]) for r in conn.execute(text("EXPLAIN QUERY PLAN " + sql)))
        assert "USING INDEX ix_tasks_" in plan, plan
        assert "TEMP B-TREE" not in plan, plan


def test_the_cli_lists_pages_and_json(cluster: Cluster, script) -> None:  # type: ignore[no-untyped-def]
    model, _ = script([{"say": "cli"}])
    task_id = charlie.submit("listed by the cli", model=model)
    charlie.wait(task_id, timeout=60)
    env = cluster.settings_env
    out = charlie_cli(env, "list", "--limit", "1", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert len(rows) == 1 and rows[0]["id"] == task_id and rows[0]["status"] == "succeeded"
    table = charlie_cli(env, "list", "--limit", "1")
    assert table.returncode == 0, table.stderr
    assert task_id in table.stdout and "succeeded" in table.stdout
    assert f"more: charlie list --limit 1 --before {task_id}" in table.stderr
    bad = charlie_cli(env, "list", "--status", "finished")
    assert bad.returncode == 2 and "unknown status 'finished'" in bad.stderr


def test_the_cli_searches_id_and_prompt(cluster: Cluster, script) -> None:  # type: ignore[no-untyped-def]
    """`charlie list --search` filters as list_tasks(search=) and the console's search box do:
    a case-insensitive substring of the id or the prompt, paged with the filter kept."""
    model, _ = script([{"say": "found"}])
    mark = uuid.uuid4().hex[:8]
    by_prompt = charlie.submit(f"Rotate the {mark.upper()} keys", model=model)
    by_id = charlie.submit("an unrelated prompt", model=model, task_id=f"job-{mark}-2")
    other = charlie.submit("nothing to see", model=model)
    for task_id in (by_prompt, by_id, other):
        charlie.wait(task_id, timeout=60)
    env = cluster.settings_env
    out = charlie_cli(env, "list", "--search", mark, "--json")
    assert out.returncode == 0, out.stderr
    assert [row["id"] for row in json.loads(out.stdout)] == [by_id, by_prompt]
    table = charlie_cli(env, "list", "--search", mark, "--limit", "1")
    assert table.returncode == 0, table.stderr
    assert by_id in table.stdout and other not in table.stdout
    assert f"more: charlie list --search {mark} --limit 1 --before {by_id}" in table.stderr
