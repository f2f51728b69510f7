"""A task stays inside its limits, through real workers.

Its workspace lies inside the operator's workspace roots (refused at submit, and again by the
worker before any tool runs); ``wait_for_task`` reads only the task's own children; a delegated
child gets no tool and no model its parent may not use (a tool error the model sees, I15, and
no child is created).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

import charlie
from charlie import api, scheduler
from charlie.api import InvalidSubmission
from charlie.domain import Phase, TaskStatus
from charlie.models import normalise_model
from charlie.runtime import get_producer
from charlie.scheduler import TaskNotFound
from charlie.store.engine import read
from charlie.store.schema import tasks
from tests.conftest import model_calls
from tests.support.cluster import REPO, Cluster

pytestmark = pytest.mark.timeout(120)


def call(cid: str, name: str, **arguments: Any) -> dict[str, Any]:
    return {"id": cid, "name": name, "arguments": arguments}


def tool_results(task_id: str) -> dict[str, Any]:
    return {i.call_id: i for i in charlie.transcript(task_id) if i.kind == "tool_result"}


def stored_tools(task_id: str) -> Any:
    with read(get_producer().engine) as conn:
        return conn.execute(select(tasks.c.tools).where(tasks.c.id == task_id)).scalar_one()


@pytest.fixture
def outside() -> Any:
    """A directory outside every workspace root of the test cluster (pytest's tmp base and
    CHARLIE_HOME/workspaces): one in the checkout, removed afterwards."""
    path = REPO / f".outside-workspace-{uuid.uuid4().hex[:8]}"
    roots = [Path(r).resolve() for r in os.environ["CHARLIE_WORKSPACE_ROOTS"].split(":")]
    if any(root in path.parents for root in roots):
        pytest.skip(f"the checkout {REPO} is inside a workspace root")
    yield path
    shutil.rmtree(path, ignore_errors=True)


# -- the workspace is confined to the roots --------------------------------------------


def test_submit_refuses_a_workspace_outside_the_roots(
    cluster: Cluster, script, outside: Path, tmp_path: Path
) -> None:
    model, _ = script([{"say": "never"}])
    up_to_etc = str(tmp_path) + "/.." * len(tmp_path.parts) + "/etc"
    for bad in (str(outside), "/", "relative/dir", up_to_etc):
        task_id = f"outside-{uuid.uuid4().hex[:8]}"
        with pytest.raises(InvalidSubmission, match="workspace"):
            charlie.submit("escape", model=model, task_id=task_id, metadata={"workspace": bad})
        with pytest.raises(TaskNotFound):
            api.get_task(task_id)  # nothing was written
    assert not outside.exists()
    # a root itself holds other tasks' workspaces: refused too, and the message names the roots
    with pytest.raises(InvalidSubmission, match="CHARLIE_WORKSPACE_ROOTS"):
        charlie.submit("root", model=model, metadata={"workspace": "/tmp"})
    # inside a root is fine
    inside = tmp_path / "ws"
    task_id = charlie.submit("fine", model=model, metadata={"workspace": str(inside)})
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED


def test_the_worker_refuses_a_saved_workspace_outside_the_roots(
    cluster: Cluster, script, outside: Path
) -> None:
    """A task saved with an outside workspace (before the roots were set, or not through
    submit): every tool call is an error result naming the rule, and nothing is written
    there, not even the directory."""
    model, _ = script(
        [
            {"tool_calls": [call("w", "write_file", path="planted.txt", content="x")]},
            {"tool_calls": [call("r", "run_command", command="echo hi > ran.txt")]},
            {"say": "refused"},
        ]
    )
    rt = get_producer()
    submitted = scheduler.submit(
        rt.engine,
        prompt="saved outside",
        model=normalise_model(model),
        tools=None,
        task_id=f"saved-outside-{uuid.uuid4().hex[:8]}",
        timeout=None,
        metadata={"workspace": str(outside)},
    )
    rt.publisher.tick(submitted.execution_id, Phase.LOAD_CONTEXT, 0)
    info = charlie.wait(submitted.task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    results = tool_results(submitted.task_id)
    for cid in ("w", "r"):
        assert results[cid].outcome == "error"
        assert "outside the allowed workspace roots" in results[cid].payload["content"]
    assert not outside.exists()


# -- wait_for_task reads only the task's own children ---------------------------------


def test_wait_for_task_reads_only_the_tasks_own_children(cluster: Cluster, script) -> None:
    other_model, _ = script([{"say": "the other tenant's secret: 7f3a"}])
    other = charlie.submit("someone else's task", model=other_model)
    assert charlie.wait(other, timeout=60).status is TaskStatus.SUCCEEDED
    model, _ = script(
        [
            {
                "tool_calls": [
                    call("peek", "wait_for_task", task_id=other),
                    call("ghost", "wait_for_task", task_id="no-such-task-anywhere"),
                ]
            },
            {"say": "not mine to read"},
        ]
    )
    task_id = charlie.submit("peek at another task", model=model)
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED
    results = tool_results(task_id)
    for cid in ("peek", "ghost"):
        assert results[cid].outcome == "error"
        assert "not a child of this task" in results[cid].payload["content"]
    assert "7f3a" not in json.dumps(results["peek"].payload)
    # one answer for "none" and "someone else's": the refusal does not say which
    assert results["peek"].payload["content"].replace(other, "X") == results["ghost"].payload[
        "content"
    ].replace("no-such-task-anywhere", "X")


# -- a child gets no more than its parent ------------------------------------------


def test_delegate_cannot_widen_the_parents_tools_or_model(cluster: Cluster, script) -> None:
    _, child_ledger = script([{"say": "child ran"}])
    model, _ = script(
        [
            {
                "tool_calls": [
                    call("wide", "delegate", prompt="write things", tools=["write_file"]),
                    call("all", "delegate", prompt="everything", model="openai:some-other-model"),
                ]
            },
            {"say": "both refused"},
        ]
    )
    parent = charlie.submit(
        "limited parent", model=model, tools=["delegate", "wait_for_task", "read_file"]
    )
    assert charlie.wait(parent, timeout=60).status is TaskStatus.SUCCEEDED
    results = tool_results(parent)
    wide = results["wide"].payload
    assert results["wide"].outcome == "error"
    assert (
        "write_file" in wide["content"] and "delegate, wait_for_task, read_file" in wide["content"]
    )
    other = results["all"].payload
    assert results["all"].outcome == "error"
    assert "openai:some-other-model" in other["content"]
    assert "CHARLIE_DELEGATE_MODELS" in other["content"]
    for cid in ("wide", "all"):
        with pytest.raises(TaskNotFound):
            api.get_task(f"{parent}.0.{cid}")  # nothing was created
    assert model_calls(child_ledger) == []


def test_a_child_without_tools_gets_its_parents_tools(cluster: Cluster, script) -> None:
    """``tools`` omitted means the parent's tools, not every registered tool; a narrower list
    and another allowed model (CHARLIE_DELEGATE_MODELS=scripted:* here) are fine."""
    child_model, _ = script(
        [
            {"tool_calls": [call("w", "write_file", path="x.txt", content="x")]},
            {"say": "child done"},
        ]
    )
    model, _ = script(
        [
            {
                "tool_calls": [
                    call("same", "delegate", prompt="inherit", model=child_model),
                    call("narrow", "delegate", prompt="narrow", tools=["read_file"]),
                ]
            },
            {
                "tool_calls": [
                    call("w1", "wait_for_task", task_id="{task_id}.0.same"),
                    call("w2", "wait_for_task", task_id="{task_id}.0.narrow"),
                ]
            },
            {"say": "done"},
        ]
    )
    parent_tools = ["delegate", "wait_for_task", "read_file"]
    parent = charlie.submit("limited parent", model=model, tools=parent_tools)
    info = charlie.wait(parent, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert stored_tools(f"{parent}.0.same") == parent_tools
    assert stored_tools(f"{parent}.0.narrow") == ["read_file"]
    assert api.get_task(f"{parent}.0.narrow").model == api.get_task(parent).model
    # the inheriting child asked for write_file, which its parent may not use either
    child_results = tool_results(f"{parent}.0.same")
    assert child_results["w"].outcome == "error"
