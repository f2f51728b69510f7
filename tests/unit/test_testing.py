"""charlie.testing runs one tool as a worker would, without a cluster: results, failures,
Pending waits, resumes and reconcile hooks (I10, I15, I19)."""

from __future__ import annotations

from pathlib import Path

import pytest

from charlie.domain import Outcome, TaskStatus
from charlie.testing import FakeChildren, ToolEnvironment
from charlie.tools.context import Pending, Reconciled, ToolContext, ToolError
from charlie.tools.registry import build_tool


def add(a: int, b: int = 1) -> int:
    """Adds."""
    return a + b


def refuse(reason: str) -> str:
    raise ToolError("refused", reason=reason)


def crash() -> str:
    raise RuntimeError("boom")


def test_a_tool_runs_with_its_context_and_its_result(tmp_path: Path) -> None:
    def where(name: str, ctx: ToolContext) -> str:
        (ctx.resolve(name)).write_text("x")
        return f"{ctx.task_id}/{ctx.call_id}"

    env = ToolEnvironment(workspace=tmp_path, task_id="t1", call_id="c7")
    done = env.run(build_tool(where), name="out.txt")
    assert (done.outcome, done.result, done.ok) == (Outcome.OK, "t1/c7", True)
    assert (tmp_path / "out.txt").read_text() == "x"
    assert env.run(add, a=2).result == 3  # a plain function works too


def test_a_tool_that_needs_approval_runs_its_handler_here(tmp_path: Path) -> None:
    """docs/tools.md: holding a call for a person is the engine's part (I23); the environment
    runs the handler as a worker does once the call was approved."""

    def deploy(service: str, ctx: ToolContext) -> str:
        ctx.resolve("deployed").write_text(service)
        return service

    env = ToolEnvironment(workspace=tmp_path)
    done = env.run(build_tool(deploy, effect="write", approval=True), service="api")
    assert done.ok and done.result == "api" and done.pending is None
    assert (tmp_path / "deployed").read_text() == "api"


def test_failures_are_results_the_model_sees() -> None:
    env = ToolEnvironment()
    refused = env.run(refuse, reason="no")
    assert refused.outcome is Outcome.ERROR
    assert refused.result == {"reason": "no", "error": "refused"}
    crashed = env.run(crash)
    assert crashed.outcome is Outcome.ERROR and "RuntimeError: boom" in crashed.result["error"]
    assert "traceback" in crashed.result
    invalid = env.run(add, a="two")
    assert invalid.outcome is Outcome.ERROR and "invalid arguments" in invalid.result["error"]


def test_a_resumable_wait_is_pending_then_resumed_with_its_handle() -> None:
    children = FakeChildren()
    children.add("child-1", parent_id="test-task")
    env = ToolEnvironment(children=children)
    waiting = env.run("wait_for_task", task_id="child-1")
    assert waiting.pending is not None and waiting.pending.handle == "child-1"
    assert not waiting.ok
    children.finish("child-1", result="42")
    done = env.resume("wait_for_task", handle="child-1", task_id="child-1")
    assert done.ok and done.result["result"] == "42"
    children.finish("child-1", TaskStatus.FAILED, error={"why": "x"})
    failed = env.resume("wait_for_task", handle="child-1", task_id="child-1")
    assert failed.outcome is Outcome.ERROR and failed.result["status"] == "failed"


def test_only_a_resumable_wait_may_be_pending() -> None:
    def not_a_wait() -> Pending:
        return Pending(handle="h")

    done = ToolEnvironment().run(not_a_wait)
    assert done.outcome is Outcome.ERROR and "not a resumable wait" in done.result["error"]


def test_delegate_starts_one_child_and_its_reconcile_finds_the_same_one() -> None:
    env = ToolEnvironment(task_id="parent", call_id="c1")
    first = env.run("delegate", prompt="do a part")
    assert first.ok and first.result == {"task_id": "parent.0.c1", "created": True}
    again = env.reconcile("delegate", prompt="do a part")
    assert again.outcome is Outcome.OK
    assert again.result["task_id"] == "parent.0.c1" and again.result["created"] is False
    assert again.result["reconciled"] is True
    assert len(env.children.submitted) == 1  # one child per delegation (I19)


def test_a_reconcile_that_cannot_tell_leaves_the_call_interrupted() -> None:
    def unsure(key: str) -> Reconciled | None:
        return None

    def sure(key: str) -> Reconciled:
        return Reconciled(Outcome.OK, {"found": key})

    def write(key: str) -> str:
        return key

    env = ToolEnvironment()
    unknown = env.reconcile(build_tool(write, effect="write", reconcile=unsure), key="k")
    assert unknown.outcome is Outcome.INTERRUPTED and unknown.result["reconciled"] is False
    found = env.reconcile(build_tool(write, effect="write", reconcile=sure), key="k")
    assert found.outcome is Outcome.OK and found.result["found"] == "k"
    with pytest.raises(ValueError, match="no reconcile hook"):
        env.reconcile(add, a=1)
