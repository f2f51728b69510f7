"""Bad input gets a clear error and loses nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import func, select

import charlie
from charlie import api
from charlie.api import InvalidSubmission, PayloadTooLarge, UnknownToolError
from charlie.domain import TaskStatus
from charlie.models import UnknownModelError
from charlie.models.scripted import ScriptError
from charlie.runtime import get_runtime
from charlie.scheduler import TaskNotFound
from charlie.store.engine import read
from charlie.store.schema import tasks
from tests.support.cluster import REPO, Cluster

pytestmark = pytest.mark.timeout(120)


def task_count() -> int:
    with read(get_runtime().engine) as conn:
        return int(conn.execute(select(func.count()).select_from(tasks)).scalar_one())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"model": "gpt-4"}, UnknownModelError, "unknown model 'gpt-4'"),
        ({"model": "scripted:/nonexistent/turns.json"}, ScriptError, "cannot read"),
        (
            {"model": "MODEL", "tools": ["read_file", "launch_rockets"]},
            UnknownToolError,
            "launch_rockets",
        ),
        ({"model": "MODEL", "task_id": "bad id!"}, InvalidSubmission, "task id"),
        ({"model": "MODEL", "timeout": -1}, InvalidSubmission, "timeout"),
        ({"model": "MODEL", "metadata": {"x": object()}}, InvalidSubmission, "JSON"),
    ],
)
def test_refused_submissions_write_nothing(
    cluster_session: Cluster, script, kwargs: dict, error: type, match: str
) -> None:
    if kwargs.get("model") == "MODEL":
        kwargs = {**kwargs, "model": script([{"say": "x"}])[0]}
    before = task_count()
    with pytest.raises(error, match=match):
        charlie.submit("hello", **kwargs)
    assert task_count() == before


def test_script_that_is_not_json_is_refused(cluster_session: Cluster, tmp_path: Path) -> None:
    bad = tmp_path / "turns.json"
    bad.write_text('[{"say": "unterminated"')
    before = task_count()
    with pytest.raises(ScriptError, match=r"turns.json is not valid JSON"):
        charlie.submit("hello", model=f"scripted:{bad}")
    assert task_count() == before


def test_oversized_prompt_is_refused(cluster_session: Cluster, script) -> None:
    before = task_count()
    with pytest.raises(PayloadTooLarge, match="limit"):
        charlie.submit("x" * (2 * 1024 * 1024), model=script([{"say": "x"}])[0])
    assert task_count() == before


def test_unknown_task_id(cluster_session: Cluster) -> None:
    with pytest.raises(TaskNotFound, match="no task with id 'missing-task'"):
        charlie.get_task("missing-task")
    with pytest.raises(TaskNotFound):
        charlie.cancel("missing-task")
    with pytest.raises(TaskNotFound):
        charlie.transcript("missing-task")
    cli = subprocess.run(
        [sys.executable, "-m", "charlie", "status", "missing-task"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=os.environ.copy(),
    )
    assert cli.returncode == 2
    assert "no task with id 'missing-task'" in cli.stderr


def test_tool_path_escaping_the_workspace_is_a_tool_error(
    cluster: Cluster, script, workspace: Path, tmp_path: Path
) -> None:
    (tmp_path / "secret.txt").write_text("top secret")
    (workspace / "innocent").symlink_to(tmp_path / "secret.txt")
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "up", "name": "read_file", "arguments": {"path": "../secret.txt"}},
                    {
                        "id": "abs",
                        "name": "write_file",
                        "arguments": {"path": "/tmp/charlie-escape", "content": "x"},
                    },
                    {"id": "link", "name": "read_file", "arguments": {"path": "innocent"}},
                ]
            },
            {"say": "refused"},
        ]
    )
    task_id = charlie.submit("escape", model=model, metadata={"workspace": str(workspace)})
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED
    results = [i for i in charlie.transcript(task_id) if i.kind == "tool_result"]
    assert [r.outcome for r in results] == ["error", "error", "error"]
    assert all("outside the task's workspace" in r.payload["content"] for r in results)
    assert "top secret" not in json.dumps([r.payload for r in results])
    assert not Path("/tmp/charlie-escape").exists()


def test_dead_broker_at_submit_loses_nothing(cluster: Cluster, script) -> None:
    """A producer whose broker is down: submit still records the task, says so, and the beat
    sweep (on a live broker) starts it (I4)."""
    model, _ = script([{"say": "started by the sweep"}])
    env = {**os.environ, "CHARLIE_BROKER_URL": "redis://127.0.0.1:1/0"}
    code = (
        f"import charlie; print(charlie.submit('dead broker', model={model!r}, "
        "task_id='dead-broker-1'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "dead-broker-1"
    assert "beat's sweep will start it" in proc.stderr
    info = charlie.wait("dead-broker-1", timeout=60)
    assert info.status is TaskStatus.SUCCEEDED
    assert info.result["answer"] == "started by the sweep"


def test_a_result_with_nul_characters_settles_ok(cluster: Cluster, script) -> None:
    """I15: a command printing NUL bytes (binary output) settles with its result, the NULs
    shown as U+FFFD; PostgreSQL's jsonb refuses a NUL, and the call used to end interrupted
    ("its worker stopped") instead."""
    model, _ = script(
        [
            {
                "tool_calls": [
                    {
                        "id": "nul",
                        "name": "run_command",
                        "arguments": {"command": "printf 'a\\000b'"},
                    }
                ]
            },
            {"say": "ok"},
        ]
    )
    task_id = charlie.submit("nul", model=model, tools=["run_command"])
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED
    (call,) = api.calls(task_id)
    assert call.outcome == "ok", call.result
    assert "a\ufffdb" in json.dumps(call.result, ensure_ascii=False)


def test_oversized_tool_result_is_truncated_and_says_so(cluster: Cluster, script) -> None:
    """A result over CHARLIE_MAX_RESULT_BYTES is cut, says so, and still settles the call."""
    limit = get_runtime().settings.max_result_bytes
    model, _ = script(
        [
            {"tool_calls": [{"id": "big", "name": "big_result", "arguments": {"size": limit * 2}}]},
            {"say": "ok"},
        ]
    )
    task_id = charlie.submit("big", model=model)
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED
    call = api.calls(task_id)[0]
    assert call.outcome == "ok"
    assert call.result["truncated"] is True
    assert call.result["original_bytes"] > limit * 2
    assert len(json.dumps(call.result)) <= limit
