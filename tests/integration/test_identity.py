"""Who acted, and how that is known (I32, I27): every operator action records the channel it
came through (Python API, CLI, console, Celery message) and whether its actor's name was
authenticated or only claimed; Celery actions can be turned off; and a worker can require
Celery's message signing, so that a broker client without a key can neither act nor drive a
run, while a whole run still completes signed."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

import charlie
from charlie import api
from charlie.app import app
from charlie.domain import TaskStatus
from tests.conftest import wait_for
from tests.integration.test_production_path import charlie_cli, doctor
from tests.support.cluster import Cluster
from tests.support.signing import cert_store, make_signer, publish
from tests.support.tools import read_ledger

pytestmark = pytest.mark.timeout(240)


def tid() -> str:
    return f"id-{uuid.uuid4().hex[:12]}"


def approved_writes(task_id: str) -> list[dict[str, object]]:
    return [e for e in read_ledger() if e.get("task") == task_id and e["event"] == "approved_write"]


def waits_for_approval(task_id: str, *call_ids: str) -> bool:
    held = {w.call_id for w in charlie.get_task(task_id).waiting_for if w.kind == "approval"}
    return set(call_ids) <= held


def worker_logs(cluster: Cluster) -> str:
    return "\n".join(
        p.read_text(errors="replace") for p in sorted(cluster.home.glob("worker-*.log"))
    )


def test_each_action_records_its_channel_and_whether_its_actor_was_authenticated(
    cluster: Cluster, script
) -> None:  # type: ignore[no-untyped-def]
    """I32: three approves of one turn's calls, one by a Celery message that names the
    console's operator (``ui:tester``), one by `charlie approve`, one by the Python API: each
    record says its channel and that its name was only claimed, and `charlie show` says so, so
    the message cannot pass for the console's signed-in action. A message that tries to say
    its own origin is refused and records nothing."""
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": k, "name": "approved_write", "arguments": {"key": k}}
                    for k in ("a", "b", "c")
                ]
            },
            {"say": "written", "tool_calls": []},
        ]
    )
    task_id = charlie.submit("identities", model=model, task_id=tid())
    wait_for(lambda: waits_for_approval(task_id, "a", "b", "c"), timeout=60)

    forged = f"forged-origin-{task_id}"
    app.send_task(
        "charlie.approve",
        args=[task_id, "a"],
        kwargs={"operator": "ui:tester", "origin": {"channel": "ui", "authenticated": True}},
        task_id=forged,
    )
    wait_for(lambda: "names its own origin" in worker_logs(cluster), timeout=60)
    assert api.action_for_request(forged) is None
    assert waits_for_approval(task_id, "a")

    app.send_task(
        "charlie.approve",
        args=[task_id, "a"],
        kwargs={"operator": "ui:tester"},
        task_id=f"m-{task_id}",
    )
    done = charlie_cli(cluster.env | {"CHARLIE_OPERATOR": "carol"}, "approve", task_id, "b")
    assert done.returncode == 0, done.stderr
    assert "carol (claimed, via CLI)" in done.stdout
    charlie.approve(task_id, "c", operator="ana")
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error

    records = {a.call_id: a for a in charlie.actions(task_id)}
    how = {k: (r.actor, r.channel, r.authenticated) for k, r in records.items()}
    assert how == {
        "a": ("ui:tester", "celery", False),
        "b": ("carol", "cli", False),
        "c": ("ana", "api", False),
    }
    assert records["a"].by == "ui:tester (claimed, via celery)"

    shown = charlie_cli(cluster.env, "show", task_id)
    assert shown.returncode == 0, shown.stderr
    assert "by ui:tester (claimed, via celery)" in shown.stdout
    assert "by carol (claimed, via CLI)" in shown.stdout
    assert "by ana (claimed, via Python API)" in shown.stdout
    assert "signed in" not in shown.stdout


def test_operator_actions_by_celery_message_can_be_turned_off(cluster: Cluster, script) -> None:  # type: ignore[no-untyped-def]
    """I32: with CHARLIE_CELERY_OPERATOR_ACTIONS=0 a worker refuses ``charlie.approve`` and
    ``charlie.send`` by message: logged, nothing recorded, the call still held; the same
    approve through the Python API then releases it."""
    model, _ = script(
        [
            {"tool_calls": [{"id": "w", "name": "approved_write", "arguments": {"key": "off"}}]},
            {"say": "written", "tool_calls": []},
        ]
    )
    with cluster.reconfigured({"CHARLIE_CELERY_OPERATOR_ACTIONS": "0"}):
        task_id = charlie.submit("no celery actions", model=model, task_id=tid())
        wait_for(lambda: waits_for_approval(task_id, "w"), timeout=60)
        approve_id, send_id = f"off-approve-{task_id}", f"off-send-{task_id}"
        app.send_task(
            "charlie.approve", args=[task_id, "w"], kwargs={"operator": "ui:tester"},
            task_id=approve_id,
        )  # fmt: skip
        app.send_task("charlie.send", args=[task_id, "hello"], task_id=send_id)
        refused = "operator actions by Celery message are turned off"
        wait_for(
            lambda: all(
                f"{refused} (CHARLIE_CELERY_OPERATOR_ACTIONS=0); nothing was recorded "
                f"(message {m})" in worker_logs(cluster)
                for m in (approve_id, send_id)
            ),
            timeout=60,
        )
        assert api.action_for_request(approve_id) is None
        assert api.action_for_request(send_id) is None
        assert charlie.actions(task_id) == []
        assert waits_for_approval(task_id, "w")
        assert not approved_writes(task_id)

        charlie.approve(task_id, "w", operator="ana")
        info = charlie.wait(task_id, timeout=90)
        assert info.status is TaskStatus.SUCCEEDED, info.error
        assert [(a.actor, a.channel) for a in charlie.actions(task_id)] == [("ana", "api")]


def test_a_worker_that_requires_signing_takes_only_signed_actions_and_runs_signed(
    cluster: Cluster, script, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Celery's message signing (CHARLIE_SECURITY_*): workers and beat that sign with their key
    and take only messages signed by a certificate in their store. A run submitted by a signed
    producer goes to its approval on signed ticks; an unsigned ``charlie.approve`` (anyone on
    the broker) and one signed with a key whose certificate is not in the store are refused
    before any task runs: the call stays held, nothing is recorded. The producer's signed
    approve is taken and the run completes, every tick and invoke signed."""
    keys = tmp_path / "keys"
    worker, producer, mallory = (make_signer(keys, n) for n in ("worker", "producer", "mallory"))
    store = cert_store(tmp_path / "trusted", worker, producer)
    model, _ = script(
        [
            {"tool_calls": [{"id": "w", "name": "approved_write", "arguments": {"key": "sig"}}]},
            {"say": "written", "tool_calls": []},
        ]
    )
    signed_env = cluster.env | producer.env(store)
    # `charlie doctor` says signing is on, and what it accepts; a worker whose own
    # certificate is not in its store (it would refuse its own next ticks) is a FAIL
    _, checks = doctor(signed_env)
    assert checks["signing"]["status"] == "ok", checks["signing"]
    assert "2 certificate(s)" in checks["signing"]["detail"]
    _, checks = doctor(cluster.env | worker.env(cert_store(tmp_path / "partial", producer)))
    assert checks["signing"]["status"] == "FAIL"
    assert "is not in its store" in checks["signing"]["detail"]
    # Every step published (no inline steps): each tick and invoke after the submit is a
    # message a worker signed and a worker took.
    with cluster.reconfigured(worker.env(store) | {"CHARLIE_INLINE_PHASES": "0"}):
        task_id = tid()
        done = charlie_cli(
            signed_env, "submit", "signed run", "--model", model, "--tool", "approved_write",
            "--task-id", task_id,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        wait_for(lambda: waits_for_approval(task_id, "w"), timeout=90)

        unsigned_refused = "Refusing to deserialize untrusted content of type json"
        forged_refused = "Unknown certificate: b'charlie-test-mallory"
        before = {m: worker_logs(cluster).count(m) for m in (unsigned_refused, forged_refused)}
        app.send_task(
            "charlie.approve", args=[task_id, "w"], kwargs={"operator": "ui:tester"},
            task_id=f"unsigned-{task_id}",
        )  # fmt: skip
        assert app.conf.task_serializer == "json"  # this test process publishes unsigned
        forged_env = cluster.env | mallory.env(cert_store(tmp_path / "own", mallory))
        serializer = publish(
            forged_env, "charlie.approve", [task_id, "w"], {"operator": "ui:tester"},
            f"forged-{task_id}",
        )  # fmt: skip
        assert serializer == "auth"

        def refused() -> bool:
            # each refused by the worker's consumer before any task ran: the unsigned one for
            # its content type, the forged one for its signer (Celery logs both)
            text = worker_logs(cluster)
            return all(text.count(m) > n for m, n in before.items())

        wait_for(refused, timeout=60)
        assert api.action_for_request(f"unsigned-{task_id}") is None
        assert api.action_for_request(f"forged-{task_id}") is None
        assert charlie.actions(task_id) == []
        assert waits_for_approval(task_id, "w")
        assert not approved_writes(task_id)

        serializer = publish(
            signed_env, "charlie.approve", [task_id, "w"], {"operator": "svc"}, f"signed-{task_id}"
        )
        assert serializer == "auth"
        info = charlie.wait(task_id, timeout=90)
        assert info.status is TaskStatus.SUCCEEDED, info.error
        assert info.result["answer"] == "written"
        (record,) = charlie.actions(task_id)
        assert (record.actor, record.channel, record.authenticated) == (
            "svc",
            "celery",
            False,
        )
        assert len(approved_writes(task_id)) == 1
