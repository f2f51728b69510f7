"""Replay of a case with today's code, on the file alone (I35): what it runs again, what it never
runs, and each kind of divergence it reports. The cases here are written by hand, their recorded
inputs computed as an export computes them (capture); tests/integration/test_replay.py exports
a real run."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tests.support.tools  # noqa: F401  (the tools the cases call)
from charlie.domain import Effect, Outcome
from charlie.executor.phases import advance_turn, load_context
from charlie.models.base import render_tool_result
from charlie.replay.case import (
    FORMAT,
    FORMAT_VERSION,
    REDACTED,
    CaseError,
    Scrubber,
    check_case,
    environment_secrets,
)
from charlie.replay.engine import DIFF_LINES, bounded_diff, replay_case
from charlie.testing import replay
from charlie.tools.registry import REGISTRY, ToolRegistry, build_tool

pytestmark = pytest.mark.backend_free

TOOLS = ["echo_number", "ledger_write", "read_file"]
#: what a write's handler did, if it ever ran in this process
RAN: list[str] = []


def _spec(name: str) -> dict[str, Any]:
    tool = REGISTRY.get(name)
    assert tool is not None
    return {"description": tool.description, "parameters": tool.parameters, "effect": tool.effect}


def make_case(
    turns: list[tuple[str, dict[str, Any], str, Any]],
    messages: dict[int, str] | None = None,
    **task: Any,
) -> dict[str, Any]:
    """A case of one task whose turn N calls turns[N] (name, arguments, outcome, result), then
    answers "done"; its recorded inputs computed by the replay itself, every call standing in,
    as an export does."""
    items: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []

    def add(turn: int, kind: str, payload: dict[str, Any], call_id: str | None = None) -> None:
        items.append(
            {"seq": len(items), "turn": turn, "kind": kind, "call_id": call_id, "payload": payload}
        )

    add(0, "input", {"role": "system", "content": load_context.SYSTEM_PROMPT})
    add(0, "input", {"role": "user", "content": "check the numbers"})
    for turn, (name, arguments, outcome, result) in enumerate(turns):
        call_id = f"c{turn}"
        raw = json.dumps(arguments)
        call = {"name": name, "arguments": arguments, "raw_arguments": raw}
        add(turn, "tool_call", call, call_id)
        content = render_tool_result(Outcome(outcome), result)
        payload = {"name": name, "outcome": outcome, "result": result, "content": content}
        add(turn, "tool_result", payload, call_id)
        if messages and turn in messages:
            message = {"role": "user", "content": messages[turn], "message_id": f"m{turn}"}
            add(turn, "input", {**message, "sent_by": "ana"})
        tool = REGISTRY.get(name)
        calls.append(
            {
                "call_id": call_id,
                "turn": turn,
                "index": 0,
                "name": name,
                "arguments": arguments,
                "effect": tool.effect.value if tool else "read",
                "state": "settled",
                "outcome": outcome,
                "result": result,
                "settled_by": "worker@test",
            }
        )
    add(len(turns), "final", {"content": "done"})
    case: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "task": {
            "id": "t-1",
            "kind": "native",
            "prompt": "check the numbers",
            "model": "scripted:recorded.json",
            "tools": TOOLS,
            "approve": None,
            "metadata": {},
            **task,
        },
        "settings": {},
        "tools": {name: _spec(name) for name in TOOLS},
        "transcript": items,
        "calls": calls,
        "actions": [],
        "model_calls": [],
        "children": [],
    }
    case["model_calls"] = replay_case(case, capture=True).model_calls
    return json.loads(json.dumps(case, default=str))


TURNS = [
    ("echo_number", {"value": 4}, "ok", {"value": 4, "half": 2.0}),
    ("ledger_write", {"key": "k1"}, "ok", {"written": "k1"}),
    ("echo_number", {"value": 6}, "ok", {"value": 6, "half": 3.0}),
]


def registry_with(**replaced: Any) -> ToolRegistry:
    """The process's tools, with some replaced (a handler) or removed (None)."""
    registry = ToolRegistry()
    for tool in REGISTRY.enabled(None):
        if tool.name not in replaced:
            registry.add(tool)
    for name, fn in replaced.items():
        if fn is not None:
            registry.add(build_tool(fn, name=name, effect=REGISTRY.get(name).effect))  # type: ignore[union-attr]
    return registry


def test_unchanged_code_replays_without_divergence() -> None:
    report = replay_case(make_case(TURNS))
    assert report.divergences == [], report.render()
    assert report.exit_code == 0 and not report.diverged
    text = report.render()
    assert "c0 echo_number" in text and "same result" in text
    assert "final answer: done" in text


def test_a_read_that_returns_something_else_is_named() -> None:
    def echo_number(value: float) -> dict[str, float]:
        """Return ``value`` and its half: a result with a float in it, whose stored form
        PostgreSQL's jsonb may change (so a worker cannot predict it and reads it back)."""
        return {"value": value, "half": value / 3}

    report = replay_case(make_case(TURNS), tools=registry_with(echo_number=echo_number))
    kinds = [(d.kind, d.call_id, d.tool, d.turn) for d in report.divergences]
    assert ("read_result", "c0", "echo_number", 0) in kinds
    assert ("read_result", "c2", "echo_number", 2) in kinds
    # the result's echo in later inputs is not reported again
    assert not [d for d in report.divergences if d.kind == "rendering"]
    first = report.divergences[0]
    assert first.recorded == {"outcome": "ok", "result": {"value": 4, "half": 2.0}}
    assert first.new["result"]["half"] == pytest.approx(4 / 3)
    assert report.exit_code == 1


def test_a_write_is_never_run_again() -> None:
    def ledger_write(key: str, hold: float = 0.0, until: str = "") -> dict[str, object]:
        """A write whose every real execution is recorded; ``hold`` keeps it running
        afterwards, and ``until`` (a path) then keeps it running until that file exists (two
        minutes at most; its end is recorded then, ``write.held_end``)."""
        RAN.append(key)
        return {"written": "again"}

    report = replay_case(make_case(TURNS), tools=registry_with(ledger_write=ledger_write))
    assert RAN == []
    assert report.exit_code == 0, report.render()
    assert "c1 ledger_write" in report.render() and "stands in" in report.render()


def test_run_writes_runs_them_in_a_scratch_copy_only(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("original")
    seen: list[Path] = []

    def ledger_write(key: str, ctx: Any, hold: float = 0.0, until: str = "") -> dict[str, object]:
        """A write whose every real execution is recorded; ``hold`` keeps it running
        afterwards, and ``until`` (a path) then keeps it running until that file exists (two
        minutes at most; its end is recorded then, ``write.held_end``)."""
        seen.append(ctx.workspace)
        (ctx.workspace / "notes.txt").write_text("overwritten")
        return {"written": key}

    from charlie.tools.context import ToolContext

    ledger_write.__annotations__["ctx"] = ToolContext
    registry = registry_with(ledger_write=ledger_write)
    report = replay_case(make_case(TURNS), tools=registry, workspace=tmp_path, run_writes=True)
    assert report.exit_code == 0, report.render()
    assert len(seen) == 1 and seen[0] != tmp_path and tmp_path not in seen[0].parents
    assert (tmp_path / "notes.txt").read_text() == "original"
    assert not seen[0].exists()  # the scratch copy is gone afterwards


def test_a_changed_schema_is_reported() -> None:
    def echo_number(value: float, unit: str) -> dict[str, float]:
        """Return ``value`` and its half, in ``unit``."""
        return {"value": value, "half": value / 2}

    report = replay_case(make_case(TURNS), tools=registry_with(echo_number=echo_number))
    kinds = {(d.kind, d.call_id) for d in report.divergences}
    assert ("tool_schema", None) in kinds
    assert ("arguments_invalid", "c0") in kinds
    schema = next(d for d in report.divergences if d.kind == "tool_schema")
    assert schema.tool == "echo_number" and "unit" in schema.how
    assert report.exit_code == 1


def test_a_removed_tool_cannot_be_replayed() -> None:
    report = replay_case(make_case(TURNS), tools=registry_with(echo_number=None))
    gone = [d for d in report.divergences if d.kind == "tool_gone"]
    assert [(d.call_id, d.tool) for d in gone] == [("c0", "echo_number"), ("c2", "echo_number")]
    assert report.exit_code == 2
    assert "is gone" in report.summary()


def test_a_changed_system_prompt_is_reported_once(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case(TURNS)
    monkeypatch.setattr(load_context, "SYSTEM_PROMPT", "You are a different agent.")
    report = replay_case(case)
    prompts = [d for d in report.divergences if d.kind == "system_prompt"]
    assert len(prompts) == 1 and prompts[0].turn == 0
    assert prompts[0].new == "You are a different agent."
    assert report.exit_code == 1


def test_a_changed_rendering_is_reported_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case(TURNS)
    monkeypatch.setattr(
        advance_turn, "render_tool_result", lambda outcome, result: f"RESULT: {result}"
    )
    report = replay_case(case)
    rendered = [(d.kind, d.call_id, d.turn) for d in report.divergences]
    assert rendered == [
        ("rendering", "c0", 1),
        ("rendering", "c1", 2),
        ("rendering", "c2", 3),
    ], report.render()


def test_a_circumstance_of_the_original_run_stands_in() -> None:
    """A read that timed out then is not a result of the code: it is not run again."""
    turns = [("echo_number", {"value": 4}, "deadline_exceeded", {"deadline_seconds": 60})]
    report = replay_case(make_case(turns))
    assert report.exit_code == 0, report.render()


def test_the_pytest_face_reads_the_file(tmp_path: Path) -> None:
    path = tmp_path / "case.json"
    path.write_text(json.dumps(make_case(TURNS)))
    report = replay(path)
    assert not report.diverged
    assert report.as_dict()["exit_code"] == 0


def test_a_case_of_another_version_or_kind_is_refused(tmp_path: Path) -> None:
    case = make_case(TURNS)
    with pytest.raises(CaseError, match="format version 2"):
        check_case({**case, "format_version": 2})
    with pytest.raises(CaseError, match="kind 'pydantic_ai'"):
        check_case({**case, "task": {**case["task"], "kind": "pydantic_ai"}})
    with pytest.raises(CaseError, match="not a Charlie case"):
        check_case({"turns": []})
    path = tmp_path / "bad.json"
    path.write_text("{")
    with pytest.raises(CaseError, match="not JSON"):
        replay(path)


def test_the_report_shows_model_text_without_obeying_it() -> None:
    turns = [("echo_number", {"value": 4}, "ok", {"value": 4, "half": 2.0})]
    case = make_case(turns, prompt="check \x1b]52;c;cm0gLXJm\x07 the \x1b[2J numbers")
    text = replay_case(case).render()
    assert "\x1b" not in text and "\x07" not in text
    assert "\\x1b]52" in text


def test_a_diff_is_bounded() -> None:
    old = {"lines": [f"line {n}" for n in range(500)]}
    new = {"lines": [f"line {n}!" for n in range(500)]}
    diff = bounded_diff(old, new)
    assert len(diff.splitlines()) <= DIFF_LINES + 1
    assert "more lines of diff" in diff


def test_secrets_are_found_in_the_environment() -> None:
    env = {
        "OPENAI_API_KEY": "sk-live-abcdef123456",
        "CHARLIE_DATABASE_URL": "postgresql://app:hunter2-long@db:5432/charlie",
        "CHARLIE_MODEL_GPT_CONTEXT_TOKENS": "128000",
        "HOME": "/root",
        "SHORT_TOKEN": "abc",
    }
    found = environment_secrets(env)
    assert "sk-live-abcdef123456" in found and "hunter2-long" in found
    assert "128000" not in found and "/root" not in found and "abc" not in found


def test_the_scrubber_blanks_secrets_everywhere() -> None:
    scrubber = Scrubber(["sk-live-abcdef123456"], [r"cus_[A-Za-z0-9]+"])
    value = scrubber.value(
        {"prompt": "use sk-live-abcdef123456 for cus_Q1w2E3", "list": ["sk-live-abcdef123456"]}
    )
    assert value == {"prompt": f"use {REDACTED} for {REDACTED}", "list": [REDACTED]}
    metadata = scrubber.metadata({"api_key": "x", "headers": {"A": "b"}, "team": "blue"})
    assert metadata == {"api_key": REDACTED, "headers": REDACTED, "team": "blue"}
    assert scrubber.count == 5
    with pytest.raises(ValueError, match="not a regular expression"):
        Scrubber([], ["("])


def test_effects_stay_what_the_record_says() -> None:
    """A tool that was a write and is declared a read today is still not run (I35)."""

    def ledger_write(key: str, hold: float = 0.0, until: str = "") -> dict[str, object]:
        """Now a read."""
        RAN.append(key)
        return {"written": key}

    registry = registry_with()
    registry.replace(build_tool(ledger_write, name="ledger_write", effect=Effect.READ))
    report = replay_case(make_case(TURNS), tools=registry)
    assert RAN == []
    assert any(d.kind == "tool_schema" and d.call_id == "c1" for d in report.divergences)


def test_a_phase_that_raises_today_is_a_divergence(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case(TURNS)

    def broken(outcome: Outcome, result: Any) -> str:
        raise RuntimeError("rendering broke")

    monkeypatch.setattr(advance_turn, "render_tool_result", broken)
    report = replay_case(case)
    (failed,) = report.divergences
    assert (failed.kind, failed.turn, failed.new) == (
        "run_failed",
        0,
        "RuntimeError: rendering broke",
    )
    assert "advance_turn" in failed.how and report.exit_code == 1


def test_a_fork_is_not_replayed_as_if_it_started_from_its_goal() -> None:
    case = make_case(TURNS)
    case["transcript"][2]["payload"]["copied_from"] = {"task": "t-0", "seq": 2}
    report = replay_case(case)
    assert report.exit_code == 2
    assert "is a fork" in report.summary()


def test_a_persons_message_and_denial_come_from_the_record() -> None:
    denied = {"denied_by": "ana", "reason": "not today"}
    turns = [TURNS[0], ("ledger_write", {"key": "k1"}, "denied", denied), TURNS[2]]
    case = make_case(turns, messages={0: "also check the six"}, approve=["ledger_write"])
    report = replay_case(case)
    assert report.exit_code == 0, report.render()
    assert "c1 ledger_write: denied (settled by worker@test, from the record)" in report.render()
    assert RAN == []
    # without the message, the input of turn 1 would have differed
    without = make_case(turns, approve=["ledger_write"])
    without["model_calls"] = case["model_calls"]
    assert any(d.kind == "input" for d in replay_case(without).divergences)


def test_the_command_exits_0_1_or_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from charlie.cli import main

    monkeypatch.setenv("CHARLIE_TOOL_MODULES", "tests.support.tools")
    path = tmp_path / "case.json"
    path.write_text(json.dumps(make_case(TURNS)))
    runner = CliRunner()
    clean = runner.invoke(main, ["replay", str(path)])
    assert clean.exit_code == 0, clean.output
    assert "nothing diverged" in clean.output
    monkeypatch.setattr(load_context, "SYSTEM_PROMPT", "You are a different agent.")
    changed = runner.invoke(main, ["replay", str(path), "--json"])
    assert changed.exit_code == 1, changed.output
    assert [d["kind"] for d in json.loads(changed.output)["divergences"]] == ["system_prompt"]
    missing = runner.invoke(main, ["replay", str(tmp_path / "nope.json")])
    assert missing.exit_code == 2 and "cannot read" in missing.output


def test_an_agent_task_is_exported_as_its_kind_and_not_replayed_as_native() -> None:
    from charlie.replay.export import _agent_of

    assert _agent_of({"team": "blue"}, "openai:gpt-4.1") is None
    named = {"agent": "shop.agents:support", "deps": None}
    found = _agent_of({"charlie.agent": named}, "openai:gpt-4.1#agent=shop.agents:support")
    assert found == {"metadata": named, "model": "openai:gpt-4.1#agent=shop.agents:support"}
    case = make_case(TURNS)
    agent_case = {**case, "task": {**case["task"], "kind": "pydantic_ai"}, "agent": found}
    assert check_case(agent_case, replaying=False) is agent_case  # an export writes it
    with pytest.raises(CaseError, match="kind 'pydantic_ai'"):
        check_case(agent_case)  # a replay refuses it (exit 2)


@pytest.fixture
def devbox_listener(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """CHARLIE_DEVBOX_URL pointed at a local HTTP listener, as in an operator's shell: the
    requests it is sent ("METHOD path"), each answered 200 {}."""
    import secrets
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from charlie.config import settings
    from tests.support.cluster import free_port

    requests: list[str] = []

    class Listener(BaseHTTPRequestHandler):
        def _any(self) -> None:
            requests.append(f"{self.command} {self.path}")
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_PUT = do_POST = do_DELETE = _any

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Listener)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("CHARLIE_DEVBOX_URL", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("CHARLIE_DEVBOX_TOKEN", secrets.token_urlsafe(32))
    settings.cache_clear()
    try:
        yield requests
    finally:
        server.shutdown()
        server.server_close()
        monkeypatch.undo()
        settings.cache_clear()


def test_a_replay_never_reaches_the_deployments_devbox(
    devbox_listener: list[str], tmp_path: Path
) -> None:
    """I35: with a devbox configured (its tools installed, as importing charlie.tools does
    when CHARLIE_DEVBOX_URL is set), neither a read nor, with --run-writes, a write of a
    devbox tool is run: they would act on the original task's devbox workspace."""
    from charlie.config import load_settings
    from charlie.tools import devbox_tools

    registry = registry_with()
    devbox_tools.install(registry, load_settings())
    turns = [
        ("read_file", {"path": "notes.txt"}, "ok", "recorded text"),
        ("write_file", {"path": "notes.txt", "content": "new"}, "ok", {"written": 3}),
        ("echo_number", {"value": 4}, "ok", {"value": 4, "half": 2.0}),
    ]
    case = make_case(turns, tools=[*TOOLS, "write_file"])
    for run_writes in (False, True):
        report = replay_case(case, tools=registry, workspace=tmp_path, run_writes=run_writes)
        text = report.render()
        assert devbox_listener == [], text
        for call_id, name in (("c0", "read_file"), ("c1", "write_file")):
            [line] = [line for line in text.splitlines() if f"{call_id} {name}(" in line]
            assert "runs against the deployment's devbox: not run" in line, text
            assert "recorded ok result stands in" in line, text
        assert not [d for d in report.divergences if d.kind in ("read_result", "write_result")]
        assert "c2 echo_number" in text and "same result" in text  # a local read still runs


def test_a_replay_never_calls_the_deployments_mcp_servers(devbox_listener: list[str]) -> None:
    """I35: an MCP server's tools, a read's too, are not run in a replay (the server, here
    the same listener, is sent nothing): their recorded results stand in."""
    import mcp_types

    from charlie.mcp.config import load
    from charlie.mcp.tools import Servers, definition

    url = os.environ["CHARLIE_DEVBOX_URL"] + "/mcp"
    config = load(None, json.dumps({"mcpServers": {"s": {"url": url}}}))
    servers = Servers(config, timeout=5.0, default_deadline=5.0)
    registry = registry_with()
    effects = {}
    for name, hint in (("r", True), ("w", False)):
        hints = mcp_types.ToolAnnotations(readOnlyHint=hint)
        made = definition(
            servers,
            config.servers[0],
            mcp_types.Tool(name=name, annotations=hints, input_schema={"type": "object"}),
        )
        assert made is not None and made.remote == "MCP server s"
        registry.add(made)
        effects[made.name] = made.effect.value
    turns = [(name, {}, "ok", {"found": name}) for name in effects]
    case = make_case(turns, tools=[*TOOLS, *effects])
    for call in case["calls"]:
        call["effect"] = effects[call["name"]]
    for run_writes in (False, True):
        text = replay_case(case, tools=registry, run_writes=run_writes).render()
        assert devbox_listener == [], text
        for name in effects:
            [line] = [line for line in text.splitlines() if f" {name}(" in line]
            assert "runs against the deployment's MCP server s: not run" in line, text


def test_a_url_password_is_blanked_whatever_the_environment() -> None:
    """I35: a URL's password goes even if the exporter's environment never held it; the rest of
    the URL stays, in the task's metadata, a child's, and a tool's result."""
    from charlie.replay.export import _scrub

    repo = "https://ci:ghp_SECRETTOKEN123@github.com/o/r.git"
    task = {"id": "t", "prompt": "p", "model": "m", "metadata": {"devbox": {"repo": repo}}}
    result = {"log": "cloned postgresql://app:s3cret-Pw@db:5432/x ok"}
    record = {"task": task, "calls": [{"result": result}], "children": [{"task": task}]}
    out = json.dumps(_scrub(record, Scrubber([])))
    assert "SECRETTOKEN123" not in out and "s3cret-Pw" not in out
    assert f"https://ci:{REDACTED}@github.com/o/r.git" in out
    assert f"postgresql://app:{REDACTED}@db:5432/x ok" in out
    assert Scrubber([]).text("see https://example.com/a@b and ftp://anon@host") == (
        "see https://example.com/a@b and ftp://anon@host"
    )


def test_metadata_lists_of_dicts_are_checked_by_key_name() -> None:
    scrubber = Scrubber([])
    metadata = scrubber.metadata(
        {"services": [{"name": "billing", "api_key": "LEAK1"}, [{"token": "LEAK2"}]]}
    )
    assert metadata == {
        "services": [{"name": "billing", "api_key": REDACTED}, [{"token": REDACTED}]]
    }
    assert scrubber.count == 2


def test_secret_fields_and_credentials_are_blanked_everywhere_in_the_case() -> None:
    """I35: headers, Authorization and their like lose their value in arguments, results and
    transcript payloads too, structured or as JSON in a string; Bearer/Basic credentials and
    known token shapes go from any string; ordinary words, counts and a ledger's key stay."""
    from charlie.replay.export import _scrub

    arguments = {"url": "https://api.example.com", "headers": {"Authorization": "Bearer LEAK4"}}
    raw = json.dumps({"password": "LEAK5-long", "key": "k1"})
    record = {
        "task": {"id": "t", "prompt": "p", "model": "m", "metadata": {}},
        "calls": [{"arguments": arguments, "result": {"auth": {"api_key": "LEAK6"}, "n": 3}}],
        "transcript": [
            {"payload": {"name": "fetch", "arguments": {"key": "k1"}, "raw_arguments": raw}},
            {
                "payload": {
                    "content": 'got {"Authorization": "Bearer LEAK7"} and {"secret": "LEAK8"}'
                }
            },
            {"payload": {"content": "curl -H 'Authorization: Basic dXNlcjpMRUFLOQ==' x"}},
            {"payload": {"content": "keys sk-proj-LEAK10abcdefghijklmnop ghp_LEAK11abcdefghij"}},
            {
                "payload": {
                    "content": "xoxb-LEAK12-abcdef AKIALEAK13ABCDEFGHIJ OPENAI_API_KEY=LEAK14xyz"
                }
            },
        ],
        "model_calls": [{"usage": {"input_tokens": 120, "output_tokens": 7}}],
        "tools": {"login": {"parameters": {"properties": {"password": {"type": "string"}}}}},
    }
    out = json.dumps(_scrub(record, Scrubber([])))
    for n in range(4, 15):
        assert f"LEAK{n}" not in out, (n, out)
    assert '"input_tokens": 120' in out and '"key": "k1"' in out and '\\"key\\": \\"k1\\"' in out
    assert '"password": {"type": "string"}' in out  # a schema replay compares stays
    assert "https://api.example.com" in out
    prose = "Basic usage: send a Bearer Token; the author of sk-learn has a password manager."
    assert Scrubber([]).text(prose) == prose


def test_a_percent_encoded_password_is_blanked_decoded_too() -> None:
    env = {"CHARLIE_BROKER_URL": "redis://app:p%40ssw0rd!@cache:6379/0"}
    found = environment_secrets(env)
    assert "p%40ssw0rd!" in found and "p@ssw0rd!" in found
    text = Scrubber(found).text("login as app with p@ssw0rd! failed")
    assert text == f"login as app with {REDACTED} failed"
