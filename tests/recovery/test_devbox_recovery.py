"""Recovery with the devbox: workers SIGKILLed mid-command and mid-commit, the devbox restarted.

The module's workers run with a devbox configured (tests/devbox/cluster_support.py). Kills come
from fault points inside the devbox tools, so they land exactly where the invariant is at stake:
right after the command started (its id recorded), in the window between the devbox starting it
and the id being recorded, and right after a commit landed (I10, I20).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import charlie
from charlie import api
from charlie.domain import TaskStatus
from tests.conftest import wait_for
from tests.devbox.cluster_support import DevboxProcess, cluster_on_devbox, git, replace_workers
from tests.integration.test_loop import assert_every_call_has_one_result
from tests.support.cluster import Cluster

pytestmark = [pytest.mark.recovery, pytest.mark.timeout(120)]

MARKED = "echo start >> marker.log; sleep 2; echo end >> marker.log; echo done"


@pytest.fixture(scope="module")
def devbox(
    cluster_session: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DevboxProcess]:
    home = tmp_path_factory.mktemp("devbox-recovery")
    env = {
        "CHARLIE_DEVBOX_COMMAND_DEADLINE": "60",
        "CHARLIE_DEVBOX_INLINE_WAIT": "1",
        "CHARLIE_DEVBOX_POLL_INTERVAL": "0.3",
    }
    with cluster_on_devbox(cluster_session, home, env) as devbox:
        yield devbox


def call(cid: str, name: str, **arguments: Any) -> dict[str, Any]:
    return {"id": cid, "name": name, "arguments": arguments}


def only_call(task_id: str, call_id: str) -> api.CallRecord:
    return next(c for c in api.calls(task_id) if c.call_id == call_id)


@pytest.mark.parametrize("point", ["devbox.after_command_started", "devbox.before_record_handle"])
def test_command_outlives_its_killed_worker_and_is_observed_to_completion(
    cluster: Cluster, devbox: DevboxProcess, script, point: str
) -> None:
    """I10, I20: the worker that started the command is SIGKILLed (after recording the
    execution id, or before it could); the command keeps running, another worker observes it
    to completion under the same id, and it was started exactly once."""
    cluster.set_faults({point: {"action": "kill", "times": 1, "match": {"tool": "run_command"}}})
    model, _ = script(
        [{"tool_calls": [call("cmd", "run_command", command=MARKED)]}, {"say": "It ran."}]
    )
    task_id = charlie.submit("kill mid command", model=model, metadata={"devbox": {}})
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert cluster.fault_count(point) == 1
    cmd = only_call(task_id, "cmd")
    assert cmd.outcome == "ok", cmd.result
    assert cmd.result["stdout"] == "done\n"
    assert cmd.result["resumed"] is True
    # one command, observed under the id recorded on the call, by a worker other than the
    # one that started it (that one is dead)
    assert devbox.commands_in(task_id) == [cmd.handle] == [cmd.result["execution_id"]]
    assert cmd.result["observed_by"] != cmd.started_by
    assert (devbox.workspace(task_id) / "marker.log").read_text() == "start\nend\n"
    assert_every_call_has_one_result(task_id)


def commits_with_key(devbox: DevboxProcess, task_id: str, key: str) -> list[str]:
    out = git(devbox.workspace(task_id), "log", "--format=%H", f"--grep={key}", "--fixed-strings")
    return out.split()


def commit_script(script) -> str:
    model, _ = script(
        [
            {"tool_calls": [call("w", "write_file", path="CHANGES", content="fixed\n")]},
            {"tool_calls": [call("c", "git_commit", message="Fix it")]},
            {"say": "Reported what the commit call settled as."},
        ]
    )
    return str(model)


def test_commit_interrupted_after_it_landed_reconciles_to_done(
    cluster: Cluster, devbox: DevboxProcess, script
) -> None:
    """I10: the worker dies after the commit landed and before the call settled; the reconcile
    hook finds the commit by its idempotency key, so the call settles ok, not unknown."""
    cluster.set_faults(
        {"devbox.after_commit": {"action": "kill", "times": 1, "match": {"tool": "git_commit"}}}
    )
    task_id = charlie.submit("commit", model=commit_script(script), metadata={"devbox": {}})
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED
    assert cluster.fault_count("devbox.after_commit") == 1
    commit = only_call(task_id, "c")
    assert commit.outcome == "ok" and commit.result["reconciled"] is True
    key = commit.result["idempotency_key"]
    assert commits_with_key(devbox, task_id, key) == [commit.result["commit"]]
    assert git(devbox.workspace(task_id), "show", "--format=", "--name-only", "HEAD") == "CHANGES"


def test_commit_interrupted_before_it_landed_reconciles_to_not_done(
    cluster: Cluster, devbox: DevboxProcess, script
) -> None:
    """I9, I10: the worker dies after the call was marked started and before the handler ran;
    the reconcile hook finds no commit with the key, so the call settles as an error that says
    it did not happen (and the commit was not made behind the model's back)."""
    cluster.set_faults(
        {"tool.after_started": {"action": "kill", "times": 1, "match": {"tool": "git_commit"}}}
    )
    task_id = charlie.submit("commit", model=commit_script(script), metadata={"devbox": {}})
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED
    assert cluster.fault_count("tool.after_started") == 1
    commit = only_call(task_id, "c")
    assert commit.outcome == "error" and commit.result["reconciled"] is True
    assert "not committed" in commit.result["error"]
    assert commits_with_key(devbox, task_id, commit.result["idempotency_key"]) == []
    seen = next(
        i for i in charlie.transcript(task_id) if i.call_id == "c" and i.kind == "tool_result"
    )
    assert "not committed" in seen.payload["content"]


def test_devbox_restart_while_a_command_runs_is_reported_lost(
    cluster: Cluster, devbox: DevboxProcess, script
) -> None:
    """The devbox is SIGKILLed and started again while a command runs: the command's outcome
    is unknowable, so the model is told it was lost, never that it succeeded or failed."""
    model, _ = script(
        [
            {"tool_calls": [call("long", "run_command", command="sleep 30")]},
            {"say": "The devbox restarted under the command; I will run it again if needed."},
        ]
    )
    task_id = charlie.submit("restart devbox", model=model, metadata={"devbox": {}})
    wait_for(lambda: any(c.handle for c in api.calls(task_id)), timeout=30)
    devbox.kill()
    devbox.start()
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    long = only_call(task_id, "long")
    assert long.outcome == "error" and long.result["status"] == "lost"
    assert long.result["execution_id"] == long.handle
    seen = next(
        i for i in charlie.transcript(task_id) if i.call_id == "long" and i.kind == "tool_result"
    )
    assert "devbox restarted while the command was running" in seen.payload["content"]
    assert devbox.commands_in(task_id) == [long.handle]  # not started again


def test_resume_without_a_handle_never_starts_the_command_again(
    cluster: Cluster, devbox: DevboxProcess, script
) -> None:
    """I10, I20: the worker dies after the devbox started the command and
    before its id was recorded, and the devbox then loses its idempotency-key files (a root
    restored from an older copy, a devbox replaced). The resume cannot confirm the command, so
    it settles the call `interrupted` with the evidence; it never starts the command again."""
    point = "devbox.before_record_handle"
    cluster.set_faults({point: {"action": "kill", "times": 1, "match": {"tool": "run_command"}}})
    model, _ = script(
        [{"tool_calls": [call("cmd", "run_command", command=MARKED)]}, {"say": "It was lost."}]
    )
    task_id = charlie.submit("keys lost", model=model, metadata={"devbox": {}})
    # The call's lease (2 s) must lapse before any resume: wipe the keys inside that window.
    wait_for(lambda: cluster.fault_count(point) == 1, timeout=30, interval=0.02)
    for key_file in (devbox.root / "commands" / "by-key").iterdir():
        key_file.unlink()
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    cmd = only_call(task_id, "cmd")
    assert cmd.outcome == "interrupted", cmd.result
    assert "not started again" in cmd.result["error"]
    assert cmd.result["idempotency_key"] and cmd.handle is None
    wait_for(lambda: devbox.status_of(task_id) == ["exited"], timeout=30)
    assert len(devbox.commands_in(task_id)) == 1  # started once
    assert (devbox.workspace(task_id) / "marker.log").read_text() == "start\nend\n"
    seen = next(
        i for i in charlie.transcript(task_id) if i.call_id == "cmd" and i.kind == "tool_result"
    )
    assert "INTERRUPTED" in seen.payload["content"]
    assert_every_call_has_one_result(task_id)


def test_a_worker_without_the_devbox_never_runs_a_devbox_command_in_its_place(
    cluster: Cluster, devbox: DevboxProcess, script
) -> None:
    """I10: a devbox worker starts run_command and is SIGKILLed mid-command;
    the workers that come back have no devbox, so their run_command is the local shell tool of
    the same name. They leave the call to a worker with the devbox's implementation; none
    comes, so once its attempts are spent the call settles `interrupted`, naming the missing
    implementation. The command never runs on a worker's host."""
    from charlie.config import settings

    command = "echo ran >> marker.log; sleep 5; echo done"
    model, _ = script(
        [{"tool_calls": [call("cmd", "run_command", command=command)]}, {"say": "Lost it."}]
    )
    task_id = charlie.submit("no devbox here", model=model, metadata={"devbox": {}})
    wait_for(lambda: any(c.handle for c in api.calls(task_id)), timeout=30)
    devbox_env = {k: v for k, v in cluster.settings_env.items() if k.startswith("CHARLIE_DEVBOX")}
    try:
        with cluster._lock:  # the supervisor restarts the killed workers without a devbox
            for key in devbox_env:
                del cluster.settings_env[key]
            for proc in cluster.alive_workers():
                cluster.kill(proc)
        info = charlie.wait(task_id, timeout=60)
        assert info.status is TaskStatus.SUCCEEDED, info.error
        cmd = only_call(task_id, "cmd")
        assert cmd.outcome == "interrupted", cmd.result
        assert cmd.result["implementation"] == "charlie.tools.devbox_tools:run_command"
        assert "charlie.tools.devbox_tools:run_command" in cmd.result["reason"]
        local = settings().workspaces_dir / task_id / "marker.log"
        assert not local.exists(), "the command ran on a worker's host"
        wait_for(lambda: devbox.status_of(task_id) == ["exited"], timeout=30)
        assert (devbox.workspace(task_id) / "marker.log").read_text() == "ran\n"
        assert_every_call_has_one_result(task_id)
    finally:
        with cluster._lock:
            cluster.settings_env.update(devbox_env)
        replace_workers(cluster)
