"""People in the loop from the `charlie` command and as Celery tasks sent by name: each action
works, is recorded with who did it (I27), and a refusal is one clear line and exit status 2."""

from __future__ import annotations

import json
import uuid

import pytest

import charlie
from charlie.domain import TaskStatus
from tests.conftest import model_calls, wait_for
from tests.integration.test_production_path import charlie_cli
from tests.support.cluster import Cluster
from tests.support.tools import read_ledger

pytestmark = pytest.mark.timeout(150)


def tid() -> str:
    return f"c-{uuid.uuid4().hex[:12]}"


def test_the_whole_loop_from_the_command_line(cluster: Cluster, script) -> None:  # type: ignore[no-untyped-def]
    """A task asks, a person answers; a write waits for approval; a message goes in; all
    through `charlie`, recorded as CHARLIE_OPERATOR."""
    model, _ = script(
        [
            {"tool_calls": [{"id": "q", "name": "ask_human", "arguments": {"question": "key?"}}]},
            {
                "expect": {"tool_results": [{"call_id": "q", "contains": "k-cli"}]},
                "tool_calls": [{"id": "w", "name": "ledger_write", "arguments": {"key": "k-cli"}}],
            },
            {
                "expect": {"contains": ["note from the cli"]},
                "tool_calls": [{"id": "d", "name": "ledger_write", "arguments": {"key": "no"}}],
            },
            {
                "expect": {"tool_results": [{"call_id": "d", "outcome": "denied"}]},
                "say": "done",
                "tool_calls": [],
            },
        ]
    )
    env = {**cluster.settings_env, "CHARLIE_OPERATOR": "cli-ana"}
    task_id = tid()
    out = charlie_cli(
        env, "submit", "cli loop", "--model", model, "--task-id", task_id, "--approve",
        "ledger_write",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    wait_for(lambda: charlie.get_task(task_id).waiting_for)
    status = charlie_cli(env, "status", task_id)
    assert "waiting for" in status.stdout and "key?" in status.stdout, status.stdout

    answered = charlie_cli(env, "reply", task_id, "q", "k-cli")
    assert answered.returncode == 0 and "reply by cli-ana" in answered.stdout, answered.stderr
    again = charlie_cli(env, "reply", task_id, "q", "other")
    assert again.returncode == 2 and "already decided: reply by cli-ana" in again.stderr

    wait_for(lambda: any(w.call_id == "w" for w in charlie.get_task(task_id).waiting_for))
    sent = charlie_cli(env, "send", task_id, "note from the cli", "--message-id", "cli-1")
    assert sent.returncode == 0 and sent.stdout.strip() == "cli-1", sent.stderr
    approved = charlie_cli(env, "approve", task_id, "w", "--note", "fine")
    assert approved.returncode == 0, approved.stderr

    wait_for(lambda: any(w.call_id == "d" for w in charlie.get_task(task_id).waiting_for))
    no_reason = charlie_cli(env, "deny", task_id, "d")
    assert no_reason.returncode == 2 and "--reason" in no_reason.stderr
    denied = charlie_cli(env, "deny", task_id, "d", "--reason", "not that key")
    assert denied.returncode == 0, denied.stderr

    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    keys = [e["key"] for e in read_ledger() if e.get("task") == task_id]
    assert keys == ["k-cli"]

    shown = charlie_cli(env, "show", task_id)
    assert shown.returncode == 0, shown.stderr
    for action in ("reply", "send", "approve", "deny"):
        assert f"{action:<9} by cli-ana" in shown.stdout, shown.stdout
    doc = json.loads(charlie_cli(env, "show", task_id, "--json").stdout)
    assert [a["action"] for a in doc["actions"]] == ["reply", "send", "approve", "deny"]
    assert {a["actor"] for a in doc["actions"]} == {"cli-ana"}

    finished = charlie_cli(env, "send", task_id, "too late")
    assert finished.returncode == 2 and "fork" in finished.stderr
    forked = charlie_cli(env, "fork", task_id, "--turn", "1", "--message", "again")
    assert forked.returncode == 0, forked.stderr
    fork_id = forked.stdout.strip()
    origin = charlie.get_task(fork_id).metadata["forked_from"]
    assert (origin["task"], origin["turn"]) == (task_id, 1)
    charlie.cancel(fork_id)


def test_reconcile_and_resume_from_the_command_line(cluster: Cluster, script, tmp_path) -> None:  # type: ignore[no-untyped-def]
    fault = tmp_path / "broken"
    fault.write_text("")
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "h", "name": "held_write", "arguments": {"key": "r", "hold": 30}}
                ]
            },
            {"raise": "model down", "raise_while": str(fault), "say": "x", "tool_calls": []},
        ]
    )
    env = {**cluster.settings_env, "CHARLIE_OPERATOR": "cli-bo"}
    task_id = charlie.submit("cli reconcile", model=model, task_id=tid())
    (run,) = wait_for(
        lambda: [
            e for e in read_ledger() if e.get("task") == task_id and e["event"] == "held_write"
        ]
    )
    cluster.kill_pid_group(int(run["pid"]))
    wait_for(lambda: charlie.get_task(task_id).waiting_for, timeout=60)
    neither = charlie_cli(env, "reconcile", task_id, "h")
    assert neither.returncode == 2 and "--done" in neither.stderr
    bad = charlie_cli(env, "reconcile", task_id, "h", "--done", "--result", "{nope")
    assert bad.returncode == 2 and "not JSON" in bad.stderr
    done = charlie_cli(
        env, "reconcile", task_id, "h", "--done", "--result", '{"written": "r"}', "--note", "seen"
    )
    assert done.returncode == 0 and "reconcile done by cli-bo" in done.stdout, done.stderr
    assert charlie.wait(task_id, timeout=90).status is TaskStatus.FAILED
    fault.unlink()
    resumed = charlie_cli(env, "resume", task_id)
    assert resumed.returncode == 0 and "resume by cli-bo" in resumed.stdout, resumed.stderr
    # the model's turn 1 plays its script again: "x", a final answer
    assert charlie.wait(task_id, timeout=90).status is TaskStatus.SUCCEEDED
    twice = charlie_cli(env, "resume", task_id)
    assert twice.returncode == 2 and "succeeded" in twice.stderr


def test_actions_are_celery_tasks_by_name(cluster: Cluster, script) -> None:  # type: ignore[no-untyped-def]
    """Item 8: a producer with only Celery sends each action by name; a redelivered message
    (the same Celery id) acts once; who acted is the operator it names."""
    from charlie.app import app

    model, _ = script(
        [
            {"tool_calls": [{"id": "w", "name": "approved_write", "arguments": {"key": "celery"}}]},
            {"expect": {"contains": ["from celery"]}, "say": "ok", "tool_calls": []},
        ]
    )
    task_id = charlie.submit("celery actions", model=model, task_id=tid())
    wait_for(lambda: charlie.get_task(task_id).waiting_for)
    app.send_task(
        "charlie.send", args=[task_id, "from celery"], kwargs={"operator": "svc"}, task_id="msg-1"
    )
    # Two messages may reach two workers in either order: approve once the send is in, so the
    # message is sure to wait for the boundary after the approved call.
    wait_for(lambda: [a for a in charlie.actions(task_id) if a.action.value == "send"])
    for _ in range(2):  # the same message twice: one approve
        app.send_task(
            "charlie.approve", args=[task_id, "w"], kwargs={"operator": "svc"}, task_id="appr-1"
        )
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    done = [(a.action.value, a.actor) for a in charlie.actions(task_id)]
    assert sorted(done) == [("approve", "svc"), ("send", "svc")]
    assert [e for e in read_ledger() if e.get("task") == task_id and e["event"] == "approved_write"]


def test_reconcile_takes_one_verdict_and_fork_takes_a_model_from_the_command_line(
    cluster: Cluster, script
) -> None:  # type: ignore[no-untyped-def]
    """Item 5 from a shell: `--done`, `--not-done` and `--unknown` are one verdict each (two
    at once are refused before anything is written, never the last of them taken); a
    `--not-done` repeats the write under the same call id, held again when it is interrupted
    again, then `--unknown` settles it `interrupted`. Item 7: `charlie fork --model`."""
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "u", "name": "approved_uncertain_write", "arguments": {"key": "cu"}}
                ]
            },
            {
                "expect": {
                    # (the note is on the call's result; the model sees it as interrupted)
                    "tool_results": [{"call_id": "u", "outcome": "interrupted"}]
                },
                "say": "told it is unknown",
                "tool_calls": [],
            },
        ]
    )
    other, other_ledger = script(
        [
            {"raise": "a fork never plays its source's turns", "tool_calls": []},
            {"say": "forked from the cli", "tool_calls": []},
        ]
    )
    env = {**cluster.settings_env, "CHARLIE_OPERATOR": "cli-cy"}
    task_id = charlie.submit("cli verdicts", model=model, task_id=tid())

    def runs() -> list[dict[str, object]]:
        return [
            e
            for e in read_ledger()
            if e.get("task") == task_id and e["event"] == "approved_uncertain_write"
        ]

    def held_for_reconcile() -> bool:
        return any(w.kind == "reconcile" for w in charlie.get_task(task_id).waiting_for)

    wait_for(lambda: charlie.get_task(task_id).waiting_for)
    assert charlie_cli(env, "approve", task_id, "u").returncode == 0
    wait_for(held_for_reconcile, timeout=60)
    assert len(runs()) == 1

    both = charlie_cli(env, "reconcile", task_id, "u", "--done", "--not-done")
    assert both.returncode == 2 and "give one verdict" in both.stderr, both.stderr
    result_too = charlie_cli(env, "reconcile", task_id, "u", "--not-done", "--result", "{}")
    assert result_too.returncode == 2 and "--result goes with --done" in result_too.stderr
    assert [a.action.value for a in charlie.actions(task_id)] == ["approve"]

    again = charlie_cli(env, "reconcile", task_id, "u", "--not-done", "--note", "never landed")
    assert again.returncode == 0, again.stderr
    assert "reconcile not_done by cli-cy" in again.stdout, again.stdout
    wait_for(lambda: len(runs()) == 2 and held_for_reconcile(), timeout=60)  # a new hold

    unknown = charlie_cli(env, "reconcile", task_id, "u", "--unknown", "--note", "cannot tell here")
    assert unknown.returncode == 0 and "reconcile unknown by cli-cy" in unknown.stdout
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    (call,) = charlie.calls(task_id)
    assert call.outcome == "interrupted" and call.result["note"] == "cannot tell here"
    assert len(runs()) == 2
    verdicts = [
        (a.action.value, (a.detail or {}).get("verdict"), a.actor) for a in charlie.actions(task_id)
    ]
    assert verdicts == [
        ("approve", None, "cli-cy"),
        ("reconcile", "not_done", "cli-cy"),
        ("reconcile", "unknown", "cli-cy"),
    ]

    fork_id = tid()
    forked = charlie_cli(
        env, "fork", task_id, "--turn", "0", "--model", other, "--task-id", fork_id
    )
    assert forked.returncode == 0 and forked.stdout.strip() == fork_id, forked.stderr
    info = charlie.wait(fork_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.model == other and info.result["answer"] == "forked from the cli"
    assert [c["turn"] for c in model_calls(other_ledger)] == [1]
    assert len(runs()) == 2  # the fork ran none of the source's calls (I26)


def test_every_action_is_a_celery_task_by_name(cluster: Cluster, script, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Item 8, the names the test above does not send: charlie.reply, charlie.deny,
    charlie.reconcile, charlie.resume, charlie.fork and charlie.cancel, each sent by name to
    the workers, each recorded as the operator it names (I27); a resume redelivered (the same
    message id) resumes once; a fork's id is its message's id, as a submit's is."""
    from charlie.app import app

    fault = tmp_path / "model-down"
    fault.write_text("")
    model, ledger = script(
        [
            {
                "tool_calls": [
                    {"id": "q", "name": "ask_human", "arguments": {"question": "which key?"}},
                    {"id": "d", "name": "ledger_write", "arguments": {"key": "never"}},
                    {"id": "u", "name": "approved_uncertain_write", "arguments": {"key": "cel"}},
                ]
            },
            {
                "expect": {
                    "tool_results": [
                        {"call_id": "q", "outcome": "ok", "contains": "the blue one"},
                        {"call_id": "d", "outcome": "denied", "contains": "not by celery"},
                        {"call_id": "u", "outcome": "ok", "contains": "seen-by-celery"},
                    ]
                },
                "raise": "model down",
                "raise_while": str(fault),
                "say": "all decided",
                "tool_calls": [],
            },
        ]
    )
    slow, slow_ledger = script(
        [{"say": "never", "tool_calls": []}, {"say": "slow", "sleep": 6, "tool_calls": []}]
    )
    task_id = charlie.submit("by name", model=model, task_id=tid(), approve=["ledger_write"])

    def waits_for(call_id: str, kind: str) -> bool:
        return any(
            (w.call_id, w.kind) == (call_id, kind) for w in charlie.get_task(task_id).waiting_for
        )

    wait_for(lambda: waits_for("u", "approval") and waits_for("d", "approval"))
    charlie.approve(task_id, "u", operator="ana")
    wait_for(lambda: waits_for("u", "reconcile"), timeout=60)

    who = {"operator": "svc"}
    app.send_task("charlie.reply", args=[task_id, "q", "the blue one"], kwargs=who)
    app.send_task("charlie.deny", args=[task_id, "d", "not by celery"], kwargs=who)
    app.send_task(
        "charlie.reconcile",
        args=[task_id, "u", "done"],
        kwargs={**who, "result": {"written": "seen-by-celery"}, "note": "checked"},
    )
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.FAILED and "model down" in str(info.error)
    wait_for(lambda: charlie.get_task(task_id).phase.value == "done")
    fault.unlink()
    for _ in range(2):  # the same message twice: one resume
        app.send_task("charlie.resume", args=[task_id], kwargs=who, task_id=f"resume-{task_id}")
    wait_for(lambda: [a for a in charlie.actions(task_id) if a.action.value == "resume"])
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.result["answer"] == "all decided"
    assert [c["turn"] for c in model_calls(ledger)] == [0, 1, 1]
    assert not [e for e in read_ledger() if e.get("task") == task_id and e["event"] == "write"]

    fork_id = f"fork-{task_id}"
    app.send_task(
        "charlie.fork",
        args=[task_id],
        kwargs={**who, "turn": 0, "model": slow, "message": "again, slowly"},
        task_id=fork_id,
    )
    wait_for(lambda: [c for c in model_calls(slow_ledger) if c["task_id"] == fork_id])
    app.send_task("charlie.cancel", args=[fork_id], kwargs={**who, "note": "enough"})
    assert charlie.wait(fork_id, timeout=60).status is TaskStatus.CANCELED
    assert [c["turn"] for c in model_calls(slow_ledger)] == [1]

    done = [(a.action.value, a.actor, a.call_id) for a in charlie.actions(task_id)]
    assert sorted(done) == sorted(
        [
            ("approve", "ana", "u"),
            ("reply", "svc", "q"),
            ("deny", "svc", "d"),
            ("reconcile", "svc", "u"),
            ("resume", "svc", None),
            ("fork", "svc", None),
        ]
    )
    (canceled,) = charlie.actions(fork_id)
    assert (canceled.action.value, canceled.actor, canceled.note) == ("cancel", "svc", "enough")
