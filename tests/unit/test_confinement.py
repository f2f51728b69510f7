"""The pure rules of confinement; the cluster tests are in
tests/integration/test_confinement.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from charlie.config import WorkspaceRefused, load_settings
from charlie.domain import TaskStatus
from charlie.tools.context import TaskSnapshot, ToolError
from charlie.tools.delegation import child_limits


def parent(tools: list[str] | None = None, model: str = "openai:gpt-parent") -> TaskSnapshot:
    return TaskSnapshot("p", TaskStatus.RUNNING, None, None, model, {}, tools=tools)


def test_a_child_gets_the_parents_tools_unless_it_names_fewer() -> None:
    assert child_limits(parent(["a", "b"]), None, None, ()) == (["a", "b"], "openai:gpt-parent")
    assert child_limits(parent(["a", "b"]), ["b"], None, ())[0] == ["b"]
    assert child_limits(parent(["a", "b"]), [], None, ())[0] == []
    # a parent that may use every tool may hand any of them on, or all (None)
    assert child_limits(parent(None), None, None, ())[0] is None
    assert child_limits(parent(None), ["x"], None, ())[0] == ["x"]
    with pytest.raises(ToolError, match=r"tool\(s\) c, d are not available") as refused:
        child_limits(parent(["a", "b"]), ["a", "c", "d"], None, ())
    assert refused.value.details == {"refused_tools": ["c", "d"], "allowed_tools": ["a", "b"]}


def test_a_child_uses_the_parents_model_unless_the_operator_allows_others() -> None:
    assert child_limits(parent(), None, "openai:gpt-parent", ())[1] == "openai:gpt-parent"
    # the default: no other model at all
    with pytest.raises(ToolError, match="CHARLIE_DELEGATE_MODELS") as refused:
        child_limits(parent(), None, "openai:gpt-other", ())
    assert refused.value.details["allowed_models"] == ["openai:gpt-parent"]
    # names and glob patterns, or "*"
    assert child_limits(parent(), None, "openai:gpt-mini", ("openai:gpt-mini",))[1] == (
        "openai:gpt-mini"
    )
    assert child_limits(parent(), None, "openai:gpt-mini", ("openai:gpt-m*",))[1] == (
        "openai:gpt-mini"
    )
    assert child_limits(parent(), None, "openai:anything", ("*",))[1] == "openai:anything"
    with pytest.raises(ToolError, match="also allows openai:gpt-m"):
        child_limits(parent(), None, "openai:big", ("openai:gpt-m*",))


def test_workspaces_are_confined_to_the_roots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHARLIE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CHARLIE_WORKSPACE_ROOTS", raising=False)
    s = load_settings()
    # default: CHARLIE_HOME/workspaces only, and strictly inside it
    assert s.allowed_workspace_roots == (tmp_path / "home" / "workspaces",)
    inside = tmp_path / "home" / "workspaces" / "t1"
    assert s.confine_workspace(str(inside)) == inside
    for bad in (str(tmp_path / "home" / "workspaces"), str(tmp_path), "/", "rel", "", 3):
        with pytest.raises(WorkspaceRefused):
            s.confine_workspace(bad)
    # a symlink inside a root that points out of it is refused by its real path
    (tmp_path / "home" / "workspaces").mkdir(parents=True)
    (tmp_path / "home" / "workspaces" / "link").symlink_to("/etc")
    with pytest.raises(WorkspaceRefused, match="outside the allowed workspace roots"):
        s.confine_workspace(str(tmp_path / "home" / "workspaces" / "link"))
    other = replace(s, workspace_roots=(tmp_path / "a", tmp_path / "b"))
    assert other.confine_workspace(str(tmp_path / "b" / "w")) == tmp_path / "b" / "w"
    with pytest.raises(WorkspaceRefused, match="outside"):
        other.confine_workspace(str(tmp_path / "home" / "workspaces" / "t1"))


def test_a_child_gets_a_scripted_model_only_from_a_scripted_parent(tmp_path: Path) -> None:
    """A script sleeps, appends to its ledger and probes for files: however the operator
    widened CHARLIE_DELEGATE_MODELS, a child of a real model never switches to one, and the
    path it names is not read (the refusal says nothing of the file)."""
    for spec in ("scripted:/etc/shadow", f"scripted:{tmp_path / 'none.json'}"):
        with pytest.raises(ToolError, match="only when its parent runs on one") as refused:
            child_limits(parent(), None, spec, ("*",))
        assert "Permission denied" not in str(refused.value)
        assert "cannot read" not in str(refused.value)
    script = tmp_path / "child.json"
    script.write_text('[{"say": "hi"}]')
    scripted_parent = parent(model=f"scripted:{tmp_path / 'parent.json'}")
    assert child_limits(scripted_parent, None, f"scripted:{script}", ("scripted:*",))[1] == (
        f"scripted:{script}"
    )
