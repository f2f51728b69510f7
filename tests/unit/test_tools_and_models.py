"""The tool registry, workspace confinement and the scripted model, as plain functions."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import pytest

from charlie.domain import ItemKind, Outcome
from charlie.models import UnknownModelError, resolve_model, validate_model_spec
from charlie.models.base import ModelError, ModelRequest, render_tool_result
from charlie.models.scripted import ScriptError
from charlie.tools.context import ToolContext, WorkspaceEscape
from charlie.tools.registry import ToolDefinitionError, build_tool


def test_schema_comes_from_the_signature() -> None:
    def search(
        query: str,
        ctx: ToolContext,
        limit: int = 5,
        mode: Literal["a", "b"] = "a",
        tags: list[str] | None = None,
    ) -> str:
        """Search things.

        More text."""
        return query

    t = build_tool(search)
    assert t.description == "Search things."
    assert t.context_param == "ctx"
    assert t.parameters["required"] == ["query"]
    props = t.parameters["properties"]
    assert props["query"] == {"type": "string"}
    assert props["limit"] == {"type": "integer", "default": 5}
    assert props["mode"]["enum"] == ["a", "b"]
    assert "ctx" not in props
    assert t.validate({"query": "x"}) is None
    assert "limit" in (t.validate({"query": "x", "limit": "many"}) or "")
    assert "query" in (t.validate({}) or "")
    assert t.validate({"query": "x", "extra": 1}) is not None


def test_only_waits_may_be_resumable() -> None:
    def f(x: str) -> str:
        return x

    with pytest.raises(ToolDefinitionError, match="resumable"):
        build_tool(f, effect="write", resumable=True)


def test_unsupported_parameter_types_are_refused() -> None:
    def f(x: object) -> str:
        return ""

    with pytest.raises(ToolDefinitionError, match="no JSON Schema"):
        build_tool(f)


def make_ctx(root: Path) -> ToolContext:
    return ToolContext("t", "x-t", "c", 0, root, {}, False, None, lambda h: None)


def test_workspace_confinement(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "secret").write_text("s")
    (ws / "link").symlink_to(tmp_path / "secret")
    ctx = make_ctx(ws)
    assert ctx.resolve("a/b.txt") == ws.resolve() / "a" / "b.txt"
    for bad in ("../secret", "/etc/passwd", "link", "a/../../secret"):
        with pytest.raises(WorkspaceEscape, match="outside the task's workspace"):
            ctx.resolve(bad)


def test_scripted_model_plays_turns(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    ledger = tmp_path / "ledger"
    path.write_text(
        json.dumps(
            {
                "ledger": ledger.name,
                "turns": [
                    {
                        "say": "a",
                        "reasoning": "why",
                        "tool_calls": [{"id": "1", "name": "t", "arguments": {"x": "{task_id}"}}],
                    },
                    {"say": "done"},
                ],
            }
        )
    )
    model = resolve_model(f"scripted:{path}")
    first = model.complete(ModelRequest("T1", "x", 0, [], []))
    assert [i.kind for i in first.output] == [
        ItemKind.REASONING,
        ItemKind.MESSAGE,
        ItemKind.TOOL_CALL,
    ]
    assert first.tool_calls[0].payload["arguments"] == {"x": "T1"}
    assert model.complete(ModelRequest("T1", "x", 1, [], [])).tool_calls == []
    with pytest.raises(ModelError, match="has 2 turns"):
        model.complete(ModelRequest("T1", "x", 2, [], []))
    assert len(ledger.read_text().splitlines()) == 3


def test_bad_model_specs_are_refused_with_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match="unknown model 'gpt'"):
        validate_model_spec("gpt")
    with pytest.raises(UnknownModelError):
        validate_model_spec("mystery:thing")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ScriptError, match="not valid JSON"):
        validate_model_spec(f"scripted:{bad}")
    with pytest.raises(ScriptError, match="cannot read"):
        validate_model_spec(f"scripted:{tmp_path / 'missing.json'}")
    bad.write_text("[]")
    with pytest.raises(ScriptError, match="non-empty list"):
        validate_model_spec(f"scripted:{bad}")


def test_a_relative_script_is_recorded_by_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/models/index.md: a relative scripted PATH is taken from the submitter's directory
    and recorded absolute, which the workers read; one that does not load is refused then."""
    from charlie.models import normalise_model

    (tmp_path / "turns.json").write_text(json.dumps([{"say": "done"}]))
    monkeypatch.chdir(tmp_path)
    assert normalise_model("scripted:turns.json") == f"scripted:{tmp_path.resolve()}/turns.json"
    with pytest.raises(ScriptError):
        normalise_model("scripted:missing.json")


def test_uncertain_outcomes_are_rendered_plainly() -> None:
    text = render_tool_result(Outcome.INTERRUPTED, {"started_at": "T", "started_by": "w1"})
    assert "cannot tell whether it took effect" in text and "w1" in text
    assert "may still be running" in render_tool_result(
        Outcome.DEADLINE_EXCEEDED, {"deadline_seconds": 5}
    )
    assert render_tool_result(Outcome.OK, {"a": 1}) == '{"a": 1}'


def test_child_ids_are_deterministic_and_fit() -> None:
    from charlie.api import TASK_ID
    from charlie.tools.delegation import child_task_id

    short = make_ctx(Path("."))
    assert child_task_id(short) == "t.0.c"
    long_parent = ToolContext(
        "p" * 119, "x", "call/1", 0, Path("."), {}, False, None, lambda h: None
    )
    other_call = ToolContext(
        "p" * 119, "x", "call/2", 0, Path("."), {}, False, None, lambda h: None
    )
    a, b = child_task_id(long_parent), child_task_id(other_call)
    assert a != b and a == child_task_id(long_parent)
    assert TASK_ID.match(a) and len(a) <= 120


def test_a_scripts_ledger_stays_in_its_directory(tmp_path: Path) -> None:
    """A ledger is relative to the script's directory: an absolute path, a ``..``, a symlink
    out of the directory are refused when the script is loaded; one put in its place later is
    not followed."""
    from charlie.models.scripted import load_script

    home = tmp_path / "scripts"
    home.mkdir()
    path = home / "s.json"

    def with_ledger(ledger: object) -> Path:
        path.write_text(json.dumps({"turns": [{"say": "x"}], "ledger": ledger}))
        return path

    assert load_script(with_ledger("calls.jsonl"))[1] == home.resolve() / "calls.jsonl"
    assert load_script(with_ledger("sub/calls.jsonl"))[1] == home.resolve() / "sub/calls.jsonl"
    for bad, says in [
        (str(tmp_path / "out.jsonl"), "is absolute"),
        ("../out.jsonl", "has a '..'"),
        ("sub/../../out.jsonl", "has a '..'"),
        (".", "outside the script's directory"),
        (7, "must be a path"),
    ]:
        with pytest.raises(ScriptError, match=re.escape(says)):
            load_script(with_ledger(bad))
    (home / "out").symlink_to(tmp_path)
    with pytest.raises(ScriptError, match="outside the script's directory"):
        load_script(with_ledger("out/calls.jsonl"))
    # a symlink put where the ledger is, after the script was loaded, is not followed
    model = resolve_model(f"scripted:{with_ledger('late.jsonl')}")
    (home / "late.jsonl").symlink_to(tmp_path / "target.jsonl")
    with pytest.raises(OSError):
        model.complete(ModelRequest("T1", "x", 0, [], []))
    assert not (tmp_path / "target.jsonl").exists()
