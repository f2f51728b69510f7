"""I31: a child never has more than its parent, whichever tool asks the engine for it (the
Children port a tool is handed: charlie/executor/children.py): tools, model, approvals, budget
and the sandbox (network access, the workspace). Through the engine's own check, on a database
of the module's own (no workers: nothing here runs a task)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, select

from charlie import scheduler
from charlie.executor.children import DbChildren
from charlie.store.engine import read
from charlie.store.schema import tasks
from charlie.tools.context import ToolError
from tests.support.databases import own_database

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with own_database(tmp_path_factory, "child_limits") as engine:
        yield engine


def children(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> DbChildren:
    from charlie.config import load_settings
    from charlie.runtime import Runtime
    from charlie.testing import RecordingPublisher
    from charlie.tools.registry import REGISTRY

    monkeypatch.setenv("CHARLIE_DATABASE_URL", str(engine.url.render_as_string(False)))
    rt = Runtime(
        settings=replace(load_settings(), delegate_models=()),
        engine=engine,
        worker="child-limits-test",
        publisher=RecordingPublisher(),  # type: ignore[arg-type]
        tools=REGISTRY,
    )
    return DbChildren(rt)


def parent(engine: Engine, workspace: Path, **metadata: Any) -> str:
    return scheduler.submit(
        engine,
        prompt="a parent",
        model="openai:gpt-4.1-mini",
        tools=["read_file", "delegate", "wait_for_task"],
        task_id=f"parent-{uuid.uuid4().hex[:8]}",
        timeout=None,
        metadata={"workspace": str(workspace), **metadata},
        approve=["read_file"],
        budget={"tokens": 1000},
    ).task_id


def test_i31_a_child_never_has_more_than_its_parent(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    port = children(engine, monkeypatch)
    workspace = tmp_path / "ws"
    parent_id = parent(engine, workspace)
    n = iter(range(100))

    def submit(**asked: Any) -> str:
        fields: dict[str, Any] = {
            "prompt": "a child",
            "model": "openai:gpt-4.1-mini",
            "tools": ["read_file"],
            "metadata": {"workspace": str(workspace)},
            **asked,
        }
        return port.submit(
            task_id=f"{parent_id}.child{next(n)}",
            parent_id=parent_id,
            parent_call_id="d1",
            **fields,
        ).task_id

    refusals = {
        "a tool its parent may not use": {"tools": ["read_file", "run_command"]},
        "another model than its operator allows": {"model": "openai:gpt-4.1"},
        "network its parent has not": {
            "metadata": {"workspace": str(workspace), "sandbox": {"network": True}}
        },
        "another workspace": {"metadata": {"workspace": str(tmp_path / "elsewhere")}},
        "a workspace out of its parent's": {"metadata": {"workspace": f"{workspace}/../other"}},
        # a directory of its parent's workspace: the parent's commands could swap it (I33)
        "a directory inside its parent's": {"metadata": {"workspace": str(workspace / "part")}},
    }
    for why, asked in refusals.items():
        with pytest.raises(ToolError):
            submit(**asked)
            pytest.fail(f"a child was given {why}")
    # a parent without a workspace gives its child none
    bare = _without_workspace(engine)
    with pytest.raises(ToolError, match="workspace"):
        port.submit(
            prompt="a child",
            model="openai:gpt-4.1-mini",
            tools=None,
            task_id=f"{bare}.c",
            metadata={"workspace": str(workspace)},
            parent_id=bare,
            parent_call_id="d1",
        )

    # What it may have: no more than its parent's, its approvals and budget included.
    child_id = submit(metadata={"workspace": str(workspace)})
    with read(engine) as conn:
        row = conn.execute(
            select(tasks.c.tools, tasks.c.approve, tasks.c.budget, tasks.c.metadata).where(
                tasks.c.id == child_id
            )
        ).one()
    assert row.tools == ["read_file"]
    assert set(row.approve or ()) >= {"read_file"}  # what its parent must ask for, it must too
    assert row.budget is not None and row.budget["tokens"] <= 1000
    assert "network" not in str(row.metadata.get("sandbox"))
    # A parent with network access may pass it on.
    networked = parent(engine, workspace, sandbox={"network": True})
    allowed = port.submit(
        prompt="a child",
        model="openai:gpt-4.1-mini",
        tools=["read_file"],
        task_id=f"{networked}.c",
        metadata={"workspace": str(workspace), "sandbox": {"network": True}},
        parent_id=networked,
        parent_call_id="d1",
    )
    assert allowed.created


def _without_workspace(engine: Engine) -> str:
    return scheduler.submit(
        engine,
        prompt="a parent without a workspace",
        model="openai:gpt-4.1-mini",
        tools=None,
        task_id=f"bare-{uuid.uuid4().hex[:8]}",
        timeout=None,
        metadata={},
    ).task_id
