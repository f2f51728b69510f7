"""The devbox tools through real workers (I13, I19, I20).

The module's workers run with a devbox configured (see tests/devbox/cluster_support.py), so
``run_command``, ``read_file``, ``write_file`` and ``list_files`` are the devbox's, beside
``apply_patch``, ``git_diff`` and ``git_commit``. Its ``run_command`` deadline is three seconds
and it observes a command for up to eight seconds before parking, which is what lets a command
outlive its deadline while a worker is still watching it (a late report).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import charlie
from charlie import api
from charlie.domain import TaskStatus
from tests.conftest import wait_for
from tests.devbox.cluster_support import DevboxProcess, cluster_on_devbox, git, make_repo
from tests.integration.test_loop import assert_every_call_has_one_result
from tests.support.cluster import Cluster

pytestmark = pytest.mark.timeout(120)

SETTINGS_24 = "COMMENT_PREFIXES = (';',)\n"
FIX = (
    "--- a/settings.py\n+++ b/settings.py\n@@ -1 +1 @@\n"
    "-COMMENT_PREFIXES = (';',)\n+COMMENT_PREFIXES = ('#', ';')\n"
)


@pytest.fixture(scope="module")
def devbox(
    cluster_session: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DevboxProcess]:
    home = tmp_path_factory.mktemp("devbox-tools")
    env = {
        "CHARLIE_DEVBOX_COMMAND_DEADLINE": "3",
        "CHARLIE_DEVBOX_INLINE_WAIT": "8",
        "CHARLIE_DEVBOX_POLL_INTERVAL": "0.3",
    }
    with cluster_on_devbox(cluster_session, home, env, output_bytes=4096) as devbox:
        yield devbox


def results(task_id: str) -> dict[str, Any]:
    return {c.call_id: c for c in api.calls(task_id)}


def call(cid: str, name: str, **arguments: Any) -> dict[str, Any]:
    return {"id": cid, "name": name, "arguments": arguments}


def test_release_flow_runs_in_one_devbox_workspace(
    cluster: Cluster, devbox: DevboxProcess, script, tmp_path: Path
) -> None:
    """Inspect, reproduce, delegate a check to a child that works in the same workspace, patch,
    test, commit: every step through the devbox, the workspace named by durable metadata."""
    upstream = tmp_path / "confparse.git"
    base = make_repo(upstream, {"settings.py": SETTINGS_24, "README.md": "confparse\n"})
    check = "python3 -c \"import settings; assert '#' in settings.COMMENT_PREFIXES\""
    child_model, _ = script(
        [
            {"tool_calls": [call("grep", "run_command", command="grep -c \"'#'\" settings.py")]},
            {"say": "'#' comments are back and ';' still works."},
        ]
    )
    model, _ = script(
        [
            {
                "tool_calls": [
                    call("ls", "list_files"),
                    call("read", "read_file", path="settings.py"),
                ]
            },
            {"tool_calls": [call("repro", "run_command", command=check)]},
            {"tool_calls": [call("patch", "apply_patch", diff=FIX)]},
            {"tool_calls": [call("d1", "delegate", prompt="check compat", model=child_model)]},
            {"tool_calls": [call("w1", "wait_for_task", task_id="{task_id}.3.d1")]},
            {
                "tool_calls": [
                    call("diff", "git_diff"),
                    call("verify", "run_command", command=check),
                ]
            },
            {"tool_calls": [call("commit", "git_commit", message="Restore '#' comments")]},
            {"say": "Fixed and committed."},
        ]
    )
    metadata = {"devbox": {"repo": str(upstream), "branch": "fix/hash", "base_commit": base}}
    task_id = charlie.submit("fix the regression", model=model, metadata=metadata)
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    calls = results(task_id)
    assert calls["ls"].result == ["README.md", "settings.py"]
    assert calls["read"].result == SETTINGS_24
    # the failing check ran in the devbox, under the execution id recorded on its call (I20)
    repro = calls["repro"]
    assert repro.outcome == "error" and repro.result["exit_code"] == 1
    assert repro.handle == repro.result["execution_id"]
    assert calls["patch"].result == {"applied": True, "files": ["settings.py"]}
    # the child saw the parent's patch: one workspace, recorded in the child's metadata (I19)
    child = api.get_task(f"{task_id}.3.d1")
    assert child.metadata["devbox"]["workspace_id"] == task_id
    grep = results(child.id)["grep"]
    assert grep.outcome == "ok" and grep.result["stdout"] == "1\n"
    assert calls["w1"].result["status"] == "succeeded"
    assert "+COMMENT_PREFIXES = ('#', ';')" in calls["diff"].result["diff"]
    assert calls["verify"].outcome == "ok" and calls["verify"].result["exit_code"] == 0
    commit = calls["commit"].result
    assert commit["created"] is True and commit["branch"] == "fix/hash"
    # the commit is in the devbox workspace, on the recorded branch, with the call's key
    ws = devbox.workspace(task_id)
    assert git(ws, "rev-parse", "HEAD") == commit["commit"]
    assert git(ws, "rev-parse", "HEAD~1") == base
    message = git(ws, "log", "-1", "--format=%B")
    assert f"Charlie-Idempotency-Key: charlie:{task_id}/6/commit" in message
    assert_every_call_has_one_result(task_id)


def test_command_past_its_deadline_settles_and_its_completion_is_a_late_report(
    cluster: Cluster, devbox: DevboxProcess, script
) -> None:
    """I13, I12: the call settles deadline_exceeded at three seconds and the run moves on; the
    command is not assumed stopped, and its completion at five seconds is counted late."""
    model, _ = script(
        [
            {"tool_calls": [call("slow", "run_command", command="sleep 5; echo finished")]},
            {"say": "It took too long; I will report that."},
        ]
    )
    task_id = charlie.submit("slow command", model=model)
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    slow = results(task_id)["slow"]
    assert slow.outcome == "deadline_exceeded"
    result = next(i for i in charlie.transcript(task_id) if i.kind == "tool_result")
    assert result.outcome == "deadline_exceeded"
    late = wait_for(lambda: results(task_id)["slow"].late_reports == 1, timeout=20)
    assert late
    assert results(task_id)["slow"].outcome == "deadline_exceeded"  # the first result stands
    # the command ran to its end in the devbox, once
    assert len(devbox.commands_in(task_id)) == 1


def test_command_parked_past_its_deadline_is_watched_to_its_late_report(
    cluster: Cluster, devbox: DevboxProcess, script
) -> None:
    """I13, I12: a command outlives both its deadline (3 s) and the worker's inline watch
    (8 s), so nobody holds it when it ends at 10 s: the late watch polls it by its execution id
    and records its end once; the command ran once."""
    model, _ = script(
        [
            {"tool_calls": [call("slow", "run_command", command="sleep 10; echo finished")]},
            {"say": "It took too long; I will report that."},
        ]
    )
    task_id = charlie.submit("parked slow command", model=model)
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert results(task_id)["slow"].outcome == "deadline_exceeded"
    wait_for(lambda: results(task_id)["slow"].late_reports == 1, timeout=40)
    slow = results(task_id)["slow"]
    late = slow.late_result
    assert late["outcome"] == "ok", late
    assert late["result"]["exit_code"] == 0 and "finished" in late["result"]["stdout"]
    assert late["result"]["execution_id"] == slow.handle
    assert slow.outcome == "deadline_exceeded"  # the first result stands
    assert len(devbox.commands_in(task_id)) == 1


def test_escapes_refused_and_output_cap_reported_to_the_model(
    cluster: Cluster, devbox: DevboxProcess, script
) -> None:
    model, _ = script(
        [
            {
                "tool_calls": [
                    call("up", "read_file", path="../../secret"),
                    call("abs", "write_file", path="/tmp/charlie-escape", content="x"),
                    call("link", "run_command", command="ln -s /etc/hostname leak"),
                ]
            },
            {
                "tool_calls": [
                    call("follow", "read_file", path="leak"),
                    call("loud", "run_command", command="python3 -c \"print('x' * 10000)\""),
                ]
            },
            {"say": "Refused, and the output was cut."},
        ]
    )
    task_id = charlie.submit("limits", model=model)
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED
    calls = results(task_id)
    assert calls["up"].outcome == "error" and "'..'" in calls["up"].result["error"]
    assert calls["abs"].outcome == "error" and "absolute" in calls["abs"].result["error"]
    assert not Path("/tmp/charlie-escape").exists()
    assert calls["link"].outcome == "ok"
    assert calls["follow"].outcome == "error"
    assert "outside the workspace" in calls["follow"].result["error"]
    loud = calls["loud"].result
    assert calls["loud"].outcome == "ok" and loud["truncated"] is True
    assert "[output truncated at 4096 bytes]" in loud["stdout"]
    assert "10001 bytes" in loud["note"]


def test_a_task_works_only_in_its_own_devbox_workspace(
    cluster: Cluster, devbox: DevboxProcess, script
) -> None:
    """Metadata cannot point a task at another task's workspace, not even
    dressed up as a delegated child; its worker's credential opens its own workspace only."""
    owner_model, _ = script(
        [
            {"tool_calls": [call("w", "write_file", path="secret.txt", content="owner's secret")]},
            {"say": "written"},
        ]
    )
    owner = charlie.submit("owner", model=owner_model)
    assert charlie.wait(owner, timeout=60).status is TaskStatus.SUCCEEDED
    assert (devbox.workspace(owner) / "secret.txt").read_text() == "owner's secret"
    intruder_model, _ = script(
        [
            {
                "tool_calls": [
                    call("r", "read_file", path="secret.txt"),
                    call("x", "run_command", command="echo planted > planted.txt"),
                ]
            },
            {"say": "refused"},
        ]
    )
    for metadata in (
        {"devbox": {"workspace_id": owner}},
        {"devbox": {"workspace_id": owner}, "delegated_by": {"task_id": owner, "call_id": "w"}},
    ):
        intruder = charlie.submit("intrude", model=intruder_model, metadata=metadata)
        assert charlie.wait(intruder, timeout=60).status is TaskStatus.SUCCEEDED
        calls = results(intruder)
        for cid in ("r", "x"):
            assert calls[cid].outcome == "error", calls[cid].result
            assert "not this task's workspace" in calls[cid].result["error"]
        assert "owner's secret" not in str(calls["r"].result)
    assert not (devbox.workspace(owner) / "planted.txt").exists()
