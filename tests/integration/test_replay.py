"""Export a task run through real workers and replay it with today's code (I35).

One task, run once for the module, does everything a replay must stand in for or run again:
reads, a write, an approval, a question to a person, a delegated child, and a compaction of its
input under a small context window. It is exported with `charlie export` by a process whose
environment holds a key; then replayed: unchanged code exits 0; a changed read tool exits 1
naming the call; a changed schema, a changed system prompt and a removed tool are each reported;
no write runs again (the ledger outside Charlie that the write tools append to); the file holds
no key of the environment.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import charlie
import tests.support.tools
from charlie.domain import TaskStatus
from charlie.executor.phases import load_context
from charlie.replay.case import SECRET_NAME, check_case
from charlie.replay.engine import replay_case
from charlie.replay.export import export_task
from charlie.testing import replay
from charlie.tools.registry import REGISTRY, ToolRegistry, build_tool
from tests.conftest import wait_for
from tests.support.cluster import REPLAY_WINDOW_TOKENS, Cluster, replay_script
from tests.support.tools import read_ledger

pytestmark = pytest.mark.timeout(240)

#: a key the deployment holds in its environment, which a person pasted into the goal
SECRET = "sk-replay-" + uuid.uuid4().hex
TOOLS = [
    "echo_number",
    "read_file",
    "big_result",
    "ledger_write",
    "approved_write",
    "ask_human",
    "delegate",
    "wait_for_task",
]


@dataclass
class Recorded:
    task_id: str
    child_id: str
    case: Path
    workspace: Path
    env: dict[str, str]


def _call(name: str, call_id: str, **arguments: object) -> dict[str, object]:
    return {"id": call_id, "name": name, "arguments": arguments}


def _script(path: Path, turns: list[dict[str, object]]) -> str:
    path.write_text(json.dumps({"turns": turns}))
    return f"scripted:{path}"


def _charlie(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "charlie", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _writes(task_ids: list[str]) -> list[dict[str, object]]:
    """What the write tools really did, by the ledger they append to (outside Charlie)."""
    return [
        e
        for e in read_ledger()
        if e.get("task") in task_ids and e.get("event") in ("write", "approved_write")
    ]


@pytest.fixture(scope="module")
def recorded(
    cluster_session: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Recorded]:
    home = tmp_path_factory.mktemp("replay")
    workspace = home / "workspace"
    workspace.mkdir()
    (workspace / "notes.txt").write_text("the notes say: ship it\n")
    child_model = _script(
        home / "child.json",
        [{"tool_calls": [_call("echo_number", "c1", value=2)]}, {"say": "two"}],
    )
    task_id = f"replay-{uuid.uuid4().hex[:10]}"
    parent = replay_script(cluster_session.home)
    parent.parent.mkdir(parents=True, exist_ok=True)
    model = _script(
        parent,
        [
            {
                "say": "reading",
                "tool_calls": [
                    _call("echo_number", "r1", value=4),
                    _call("read_file", "r2", path="notes.txt"),
                ],
            },
            {"tool_calls": [_call("ledger_write", "w1", key=f"{task_id}-w")]},
            {"tool_calls": [_call("approved_write", "a1", key=f"{task_id}-a")]},
            {"tool_calls": [_call("ask_human", "q1", question="which colour?")]},
            {
                "tool_calls": [
                    _call(
                        "delegate",
                        "d1",
                        prompt="count to two",
                        model=child_model,
                        tools=["echo_number"],
                    )
                ]
            },
            {"tool_calls": [_call("wait_for_task", "t1", task_id="{task_id}.4.d1")]},
            {"tool_calls": [_call("big_result", "b1", size=1900)]},
            {"tool_calls": [_call("big_result", "b2", size=1900)]},
            {"tool_calls": [_call("big_result", "b3", size=1900)]},
            {"tool_calls": [_call("echo_number", "r3", value=8)]},
            {"say": "all done"},
        ],
    )
    cluster_session.ensure(workers=2, beat=True)
    charlie.submit(
        f"ship the release; the deploy key is {SECRET}",
        model=model,
        tools=TOOLS,
        task_id=task_id,
        metadata={"workspace": str(workspace), "api_key": SECRET},
    )
    waiting = lambda call: any(  # noqa: E731
        w.call_id == call for w in charlie.get_task(task_id).waiting_for
    )
    wait_for(lambda: waiting("a1"), timeout=60)
    charlie.approve(task_id, "a1", note="fine")
    wait_for(lambda: waiting("q1"), timeout=60)
    charlie.reply(task_id, "q1", "blue")
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    # the exporting process holds a key in its environment
    env = {**cluster_session.env, "CHARLIE_REPLAY_TEST_API_KEY": SECRET}
    case = home / "case.json"
    done = _charlie(env, "export", task_id, "-o", str(case), "--redact", "colou?r")
    assert done.returncode == 0, done.stdout + done.stderr
    yield Recorded(task_id, f"{task_id}.4.d1", case, workspace, env)


def test_the_case_holds_the_whole_record_and_no_secret(recorded: Recorded) -> None:
    text = recorded.case.read_text()
    case = json.loads(text)
    assert case["format"] == "charlie-case" and case["format_version"] == 1
    kinds = [i["kind"] for i in case["transcript"]]
    assert "compaction" in kinds, "the run was meant to compact its input once"
    calls = {c["call_id"]: c for c in case["calls"]}
    assert {"r1", "r2", "w1", "a1", "q1", "d1", "t1", "r3"} <= set(calls)
    assert calls["q1"]["result"] == "blue" or "blue" in json.dumps(calls["q1"]["result"])
    assert [a["action"] for a in case["actions"]] == ["approve", "reply"]
    (child,) = case["children"]
    assert child["task"]["id"] == recorded.child_id
    assert [c["call_id"] for c in child["calls"]] == ["c1"]
    assert any(m["purpose"] == "summary" for m in case["model_calls"])
    windows = case["settings"]["context_tokens_by_model"]
    assert list(windows.values()) == [REPLAY_WINDOW_TOKENS]
    # no key of the exporting environment, wherever the run quoted it
    assert SECRET not in text
    for name, value in recorded.env.items():
        if SECRET_NAME.search(name) and len(value) >= 6 and not value.isdigit():
            assert value not in text, f"the value of {name} is in the case"
    assert case["task"]["metadata"]["api_key"] == "[redacted]"
    assert "[redacted]" in case["task"]["prompt"]
    # --redact blanked more: the question, wherever it was quoted
    assert "colour" not in text and "which [redacted]?" in text


def test_unchanged_code_replays_with_exit_0_and_no_write(recorded: Recorded) -> None:
    ids = [recorded.task_id, recorded.child_id]
    before = _writes(ids)
    assert len(before) == 2  # the write and the approved write, once each
    run = _charlie(
        recorded.env, "replay", str(recorded.case), "--workspace", str(recorded.workspace)
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "nothing diverged" in run.stdout
    assert "approved (approve by" in run.stdout and "a person's answer" in run.stdout
    assert f"delegated task {recorded.child_id}" in run.stdout
    assert "compaction of items" in run.stdout
    assert _writes(ids) == before  # I35: no write ran again
    assert (recorded.workspace / "notes.txt").read_text() == "the notes say: ship it\n"
    # `charlie replay TASK_ID`: exported through the API, then replayed from that form
    again = replay_case(check_case(export_task(recorded.task_id)), workspace=recorded.workspace)
    assert again.exit_code == 0, again.render()
    assert _writes(ids) == before


def test_a_changed_read_tool_exits_1_naming_the_call(recorded: Recorded) -> None:
    env = {**recorded.env, "CHARLIE_TOOL_MODULES": "tests.support.replay_changed"}
    run = _charlie(
        env, "replay", str(recorded.case), "--workspace", str(recorded.workspace), "--json"
    )
    assert run.returncode == 1, run.stdout + run.stderr
    found = json.loads(run.stdout)
    reads = {(d["task_id"], d["call_id"]) for d in found["divergences"]}
    assert reads == {
        (recorded.task_id, "r1"),
        (recorded.task_id, "r3"),
        (recorded.child_id, "c1"),
    }
    assert {d["kind"] for d in found["divergences"]} == {"read_result"}
    first = next(d for d in found["divergences"] if d["call_id"] == "r1")
    assert first["tool"] == "echo_number" and first["turn"] == 0
    assert first["new"]["result"]["changed"] is True


def _registry(**replaced: object) -> ToolRegistry:
    registry = ToolRegistry()
    for tool in REGISTRY.enabled(None):
        if tool.name not in replaced:
            registry.add(tool)
    for name, fn in replaced.items():
        if fn is not None:
            registry.add(build_tool(fn, name=name, effect="read"))  # type: ignore[arg-type]
    return registry


def test_a_changed_schema_a_prompt_and_a_removed_tool_are_each_reported(
    recorded: Recorded, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert tests.support.tools.echo_number  # the tools the case calls are this process's too

    def echo_number(value: float, precision: int) -> dict[str, float]:
        """Return ``value`` and its half, to a precision."""
        return {"value": value, "half": value / 2}

    changed = replay(recorded.case, tools=_registry(echo_number=echo_number))
    kinds = {(d.kind, d.call_id) for d in changed.divergences}
    assert ("tool_schema", None) in kinds and ("arguments_invalid", "r1") in kinds
    assert changed.exit_code == 1

    removed = replay(recorded.case, tools=_registry(read_file=None))
    gone = [(d.kind, d.call_id, d.tool) for d in removed.divergences if d.kind == "tool_gone"]
    assert gone == [("tool_gone", "r2", "read_file")]
    assert removed.exit_code == 2

    monkeypatch.setattr(load_context, "SYSTEM_PROMPT", "You are a careless agent.")
    prompt = replay(recorded.case, workspace=recorded.workspace)
    assert [d.kind for d in prompt.divergences] == ["system_prompt"]
    assert prompt.divergences[0].recorded != prompt.divergences[0].new
    # the child's input shows the changed prompt too
    assert [d.kind for d in prompt.all_divergences()] == ["system_prompt", "system_prompt"]
