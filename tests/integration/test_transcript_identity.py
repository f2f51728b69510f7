"""What a worker remembers of a run's transcript (store.transcripts) is never served for another
run under the same execution id (I6, I29): a task id used again after its rows are gone (a
backup restored from before it), or a database recreated under its name from a copy of itself
(the same run, its transcript gone another way since). On the real database, with no workers:
the cache is a worker process's memory, and which pool process takes a tick is not the test's
to choose.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, delete, text, update
from sqlalchemy.engine import make_url

from charlie import scheduler
from charlie.domain import Item, ItemKind, NewItem, Phase, Transition, utcnow
from charlie.executor.steps import remember_transcript, transcript_of
from charlie.store import runs
from charlie.store.engine import write
from charlie.store.schema import executions, tasks, transcript_items, transitions
from charlie.store.transcripts import TranscriptCache
from tests.support.databases import own_database

OWNER = "transcript-identity@test"


@pytest.fixture
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """A database of its own (recreated by one test): no worker or sweep touches it."""
    with own_database(tmp_path_factory, "transcript_identity") as engine:
        yield engine


def _worker() -> Any:
    """What transcript_of and remember_transcript use of a worker's runtime: its cache."""
    return SimpleNamespace(transcripts=TranscriptCache())


def _claim(engine: Engine, execution_id: str, version: int) -> runs.Claim:
    with write(engine) as conn:
        claim = runs.claim_execution(
            conn, execution_id, Phase.CALL_MODEL, version, OWNER, utcnow(), lease_seconds=0
        )
    assert claim is not None
    return claim


def _submit(engine: Engine, task_id: str, prompt: str) -> runs.Claim:
    submitted = scheduler.submit(
        engine, prompt=prompt, model="none", tools=None, task_id=task_id, timeout=None,
        metadata=None,
    )  # fmt: skip
    with write(engine) as conn:
        conn.execute(
            update(executions)
            .where(executions.c.id == submitted.execution_id)
            .values(phase=Phase.CALL_MODEL.value, version=7)
        )
    return _claim(engine, submitted.execution_id, 7)


def _append(
    worker: Any, engine: Engine, claim: runs.Claim, text_: str, kind: ItemKind = ItemKind.INPUT
) -> runs.Claim:
    """Commit one item as a step of the run (call_model -> call_model) and remember it as a
    worker does after the COMMIT of a step that read no transcript (load_context, a tool
    phase: what it remembers, then what it wrote); returns the next step's claim."""
    payload: dict[str, Any] = {"role": "user", "content": text_}
    if kind is ItemKind.COMPACTION:
        payload = {"covers": [1, 2], "content": text_, "model": "m", "usage": {}}
    moved = Transition(to=Phase.CALL_MODEL, items=[NewItem(kind, payload)])
    with write(engine) as conn:
        assert runs.commit_transition(conn, claim, moved, owner=OWNER, now=utcnow(), duration_ms=1)
        wrote = [(claim.next_seq, runs.written_items(conn, claim, moved))]
    remember_transcript(worker, claim, None, wrote, None)
    return _claim(engine, claim.execution_id, claim.version + 1)


def _model_input(worker: Any, engine: Engine, claim: runs.Claim) -> list[str]:
    with write(engine) as conn:
        items: list[Item] = transcript_of(worker, conn, claim, ())[0]
    return [str(i.payload.get("content")) for i in items]


def test_a_task_id_used_again_after_its_rows_are_gone_reads_its_own_transcript(
    engine: Engine,
) -> None:
    """The run remembered under an id, its rows gone (a backup restored from before it), and a
    task submitted again under that id: its model input is its own transcript, not the one
    remembered (the run's incarnation differs)."""
    worker = _worker()
    old = _submit(engine, "reused-id", "old")
    _append(worker, engine, old, "the old task's input")
    with write(engine) as conn:
        for table in (transcript_items, transitions):
            conn.execute(delete(table).where(table.c.execution_id == old.execution_id))
        conn.execute(delete(executions).where(executions.c.id == old.execution_id))
        conn.execute(delete(tasks).where(tasks.c.id == "reused-id"))
    new = _submit(engine, "reused-id", "new")
    assert new.execution_id == old.execution_id
    after = _append(worker, engine, new, "the new task's input")
    assert _model_input(worker, engine, after) == ["the new task's input"]


def _copy_database(engine: Engine, to: str) -> None:
    """A backup of the database ``engine`` reaches, as it is now."""
    url = make_url(str(engine.url.render_as_string(hide_password=False)))
    engine.dispose()
    if url.get_backend_name() == "sqlite":
        assert url.database is not None
        with sqlite3.connect(url.database) as src, sqlite3.connect(to) as dst:
            src.backup(dst)
        return
    admin = create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{to}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{to}" TEMPLATE "{url.database}"'))
    admin.dispose()


def _restore_database(engine: Engine, backup: str) -> None:
    """The database recreated under its name from ``backup``; the engine's connections are
    dropped (the old database is gone), new ones reach the restored one."""
    url = make_url(str(engine.url.render_as_string(hide_password=False)))
    engine.dispose()
    if url.get_backend_name() == "sqlite":
        assert url.database is not None
        for suffix in ("-wal", "-shm"):
            Path(url.database + suffix).unlink(missing_ok=True)
        copy = f"{url.database}.restoring"
        shutil.copyfile(backup, copy)
        os.replace(copy, url.database)
        return
    admin = create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE "{url.database}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{url.database}" TEMPLATE "{backup}"'))
    admin.dispose()


def test_a_database_restored_from_a_backup_is_not_mixed_with_what_was_remembered(
    engine: Engine, tmp_path: Path
) -> None:
    """The same run (same id, same creation) in a database recreated from a backup taken
    before its last item: the worker that remembered that item must not serve it once the
    restored run has written another in its place (the database is another one)."""
    worker = _worker()
    claim = _submit(engine, "restored", "prompt")
    claim = _append(worker, engine, claim, "the first input")
    backup = (
        str(tmp_path / "backup.db")
        if engine.dialect.name == "sqlite"
        else f"{engine.url.database}_backup"
    )
    _copy_database(engine, backup)
    lost = _append(worker, engine, claim, "an input the restore loses")
    assert _model_input(worker, engine, lost) == ["the first input", "an input the restore loses"]

    _restore_database(engine, backup)
    again = _claim(engine, claim.execution_id, claim.version)
    assert again.identity[1] == claim.identity[1]  # the same run, restored
    after = _append(worker, engine, again, "what the restored run wrote instead")
    assert _model_input(worker, engine, after) == [
        "the first input",
        "what the restored run wrote instead",
    ]


def test_what_a_worker_knows_of_a_runs_compactions_is_what_a_walk_finds(engine: Engine) -> None:
    """The transcript a model call plans from comes with where its newest compaction is in the
    prefix this worker remembers (I29: the planning walks only what follows); a worker that
    remembers nothing knows nothing, and reads the whole transcript."""
    worker = _worker()
    claim = _submit(engine, "compacted", "prompt")
    for n in range(3):
        claim = _append(worker, engine, claim, f"input {n}")
    claim = _append(worker, engine, claim, "the summary", ItemKind.COMPACTION)
    claim = _append(worker, engine, claim, "input after it")
    with write(engine) as conn:
        items, known = transcript_of(worker, conn, claim, ())
        cold, nothing = transcript_of(_worker(), conn, claim, ())
    newest = max(n for n, i in enumerate(items) if i.kind is ItemKind.COMPACTION)
    assert known == (len(items), newest) and items[newest].payload["content"] == "the summary"
    assert [i.seq for i in cold] == [i.seq for i in items] and nothing is None
    claim = _append(worker, engine, claim, "a newer summary", ItemKind.COMPACTION)
    with write(engine) as conn:
        items, known = transcript_of(worker, conn, claim, ())
    assert known == (len(items), len(items) - 1)
