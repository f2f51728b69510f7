"""Budgets through real workers: a scripted run stops before the model call that
would start past its budget, fails saying which budget and how much was used, and its later
turns are never asked for; a resume needs room in the budget; defaults come from settings."""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

import charlie
from charlie import api, runtime
from charlie.domain import TaskStatus
from charlie.models.base import ModelRequest
from charlie.models.scripted import ScriptedModel
from tests.conftest import model_calls
from tests.integration.test_loop import assert_every_call_has_one_result
from tests.support.cluster import Cluster

pytestmark = pytest.mark.timeout(120)


def tid() -> str:
    return f"b-{uuid.uuid4().hex[:12]}"


def tool_turn(n: int) -> dict[str, Any]:
    return {
        "tool_calls": [
            {"id": f"c{n}", "name": "sleep_then", "arguments": {"seconds": 0, "value": f"v{n}"}}
        ]
    }


TURNS = [tool_turn(0), tool_turn(1), tool_turn(2), {"say": "all done", "tool_calls": []}]


def assert_stopped_by(info: api.TaskInfo, budget: str, limit: int, used: int) -> None:
    assert info.status is TaskStatus.FAILED, info
    error = info.error
    assert error["reason"] == "budget exceeded", error
    assert error["budget"] == budget and error["limit"] == limit and error["used"] == used
    assert error["phase"] == "call_model" and error["type"] == "BudgetExceeded"
    assert error["usage"]["model_calls"] == info.model_calls
    assert f"{budget} budget exceeded" in error["message"]


def test_a_model_calls_budget_stops_the_run_before_its_third_model_call(
    cluster: Cluster, script
) -> None:
    model, ledger = script(TURNS)
    task_id = charlie.submit(
        "spend two calls", model=model, task_id=tid(), budget={"model_calls": 2}
    )
    assert charlie.get_task(task_id).budget == {"model_calls": 2}
    info = charlie.wait(task_id, timeout=60)
    assert_stopped_by(info, "model_calls", 2, 2)
    assert info.model_calls == 2  # executions.model_calls, in the database
    assert [c["turn"] for c in model_calls(ledger)] == [0, 1]  # turn 2 was never asked for
    assert info.cost_usd == 0.0  # scripted models are free
    items = charlie.transcript(task_id)
    assert {i.call_id for i in items if i.kind == "tool_result"} == {"c0", "c1"}
    assert not [i for i in items if i.kind == "final"]
    assert_every_call_has_one_result(task_id)
    notes = [h["note"] for h in charlie.history(task_id) if h["to_phase"] == "report_failure"]
    assert len(notes) == 1 and "model_calls budget exceeded" in notes[0]

    # A resume with the spent budget would fail again at once: refused, and nothing moved.
    with pytest.raises(api.NotResumable, match="larger budget"):
        charlie.resume(task_id)
    with pytest.raises(api.NotResumable, match="model_calls budget exceeded"):
        charlie.resume(task_id, budget={"model_calls": 2})
    assert charlie.get_task(task_id).status is TaskStatus.FAILED
    # A fork inherits the budget, with usage of its own: two more calls, then it stops too.
    fork = charlie.fork(task_id, turn=0, task_id=tid())
    assert charlie.get_task(fork).budget == {"model_calls": 2}
    forked = charlie.wait(fork, timeout=60)
    assert_stopped_by(forked, "model_calls", 2, 2)

    # With room, it goes on where it stopped and the budget stored is the raised one.
    record = charlie.resume(task_id, budget={"model_calls": 4})
    assert record.detail["budget"] == {"model_calls": 4}
    assert record.detail["ended_with"]["reason"] == "budget exceeded"
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.result["answer"] == "all done" and info.budget == {"model_calls": 4}
    assert info.model_calls == 4
    assert [c["turn"] for c in model_calls(ledger)][-2:] == [2, 3]


def tokens_of(turn: dict[str, Any], tmp_path: Path) -> int:
    """The tokens the scripted model reports for this turn (without touching a ledger)."""
    path = tmp_path / f"probe-{uuid.uuid4().hex[:8]}.json"
    path.write_text(json.dumps({"turns": [turn]}))
    model = ScriptedModel(f"scripted:{path}", path)
    response = model.complete(ModelRequest("probe", "x-probe", 0, [], []))
    return response.usage.input_tokens + response.usage.output_tokens


def test_a_tokens_budget_stops_the_run_before_its_third_model_call(
    cluster: Cluster, script, tmp_path: Path
) -> None:
    per_turn = tokens_of(tool_turn(0), tmp_path)
    assert per_turn > 0
    model, ledger = script(TURNS)
    limit = 2 * per_turn  # reached by the second call, not by the first
    task_id = charlie.submit("spend tokens", model=model, task_id=tid(), budget={"tokens": limit})
    info = charlie.wait(task_id, timeout=60)
    assert_stopped_by(info, "tokens", limit, 2 * per_turn)
    assert info.model_calls == 2
    assert info.usage["input_tokens"] + info.usage["output_tokens"] == 2 * per_turn
    assert [c["turn"] for c in model_calls(ledger)] == [0, 1]


@pytest.mark.parametrize(
    ("budget", "says"),
    [
        ({"tokens": 0}, "budget tokens must be positive"),
        ({"model_calls": -3}, "budget model_calls must be positive"),
        ({"model_calls": 2.5}, "whole number"),
        ({"dollars": 1}, "unknown budget key(s) dollars"),
        ("100", "budget must be an object"),
        ({"usd": 1.0}, "add it to CHARLIE_PRICES"),
    ],
)
def test_a_bad_budget_is_refused_at_submit_and_writes_nothing(
    cluster: Cluster, budget: Any, says: str
) -> None:
    task_id = tid()
    with pytest.raises(api.InvalidSubmission) as refused:
        charlie.submit("x", model="openai:no-such-price", task_id=task_id, budget=budget)
    assert says in str(refused.value)
    with pytest.raises(api.TaskNotFound):
        charlie.get_task(task_id)


def test_defaults_from_settings_are_stored_at_submit(
    cluster: Cluster, script, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer = runtime.get_producer()
    with_defaults = dataclasses.replace(
        producer.settings, budget_model_calls=1, budget_tokens=10**6
    )
    # whichever face this process submits through (a worker's runtime, if a test built one)
    monkeypatch.setattr(producer, "settings", with_defaults)
    model, ledger = script(TURNS)
    task_id = charlie.submit("defaults", model=model, task_id=tid())
    mine = charlie.submit("mine", model=model, task_id=tid(), budget={"model_calls": 3})
    none = charlie.submit(
        "none", model=model, task_id=tid(), budget={"model_calls": None, "tokens": None}
    )
    monkeypatch.undo()  # the settings change; a task's budget does not
    assert charlie.get_task(task_id).budget == {"model_calls": 1, "tokens": 10**6}
    assert charlie.get_task(mine).budget == {"model_calls": 3, "tokens": 10**6}
    assert charlie.get_task(none).budget is None
    assert_stopped_by(charlie.wait(task_id, timeout=60), "model_calls", 1, 1)
    assert_stopped_by(charlie.wait(mine, timeout=60), "model_calls", 3, 3)
    assert charlie.wait(none, timeout=60).status is TaskStatus.SUCCEEDED
    turns = [(c["task_id"], c["turn"]) for c in model_calls(ledger)]
    assert [t for x, t in turns if x == task_id] == [0]
    assert [t for x, t in turns if x == mine] == [0, 1, 2]


def test_the_cli_submits_with_a_budget_and_status_shows_cost_and_budget(
    cluster: Cluster, script
) -> None:
    from tests.integration.test_production_path import charlie_cli

    model, ledger = script(TURNS)
    task_id = tid()
    # This process prices scripted turns (the workers' table does not: for them they cost 0).
    env = {**cluster.settings_env, "CHARLIE_PRICES": '{"scripted:": {"input": 1, "output": 1000}}'}
    submitted = charlie_cli(
        env,
        "submit",
        "cli budget",
        "--model",
        model,
        "--task-id",
        task_id,
        "--budget-model-calls",
        "1",
        "--budget-usd",
        "5",
    )
    assert submitted.returncode == 0, submitted.stderr
    info = charlie.wait(task_id, timeout=60)
    assert_stopped_by(info, "model_calls", 1, 1)
    assert info.budget == {"model_calls": 1, "usd": 5.0}
    status = charlie_cli(env, "status", task_id)
    assert status.returncode == 0, status.stderr
    lines = {line.split(None, 1)[0]: line for line in status.stdout.splitlines() if line.strip()}
    cost = info.usage["output_tokens"] * 1000 / 1e6
    assert f"${cost:.4f}" in lines["cost"], status.stdout
    assert f"model_calls 1 of 1, usd ${cost:.4f} of $5.0000" in lines["budget"], status.stdout
    refused = charlie_cli(env, "submit", "x", "--model", model, "--budget-tokens", "-5")
    assert refused.returncode != 0 and "budget tokens must be positive" in refused.stderr
    resumed = charlie_cli(env, "resume", task_id)
    assert resumed.returncode != 0 and "--budget-model-calls MORE" in resumed.stderr
    assert [c["turn"] for c in model_calls(ledger)] == [0]


def test_a_celery_message_submits_with_a_budget(cluster: Cluster, script) -> None:
    from charlie.app import app
    from tests.conftest import wait_for

    model, ledger = script(TURNS)
    task_id = tid()
    app.send_task(
        "charlie.submit",
        kwargs={
            "prompt": "by name",
            "model": model,
            "task_id": task_id,
            "budget": {"model_calls": 1},
        },
    )

    def exists() -> bool:
        try:
            charlie.get_task(task_id)
        except api.TaskNotFound:
            return False
        return True

    wait_for(exists, timeout=60)
    assert_stopped_by(charlie.wait(task_id, timeout=60), "model_calls", 1, 1)
    assert [c["turn"] for c in model_calls(ledger)] == [0]


def test_a_model_call_that_commits_after_its_task_was_canceled_still_counts_its_tokens(
    cluster: Cluster, script
) -> None:
    """The call was made and paid for: a stop must not lose its usage (a resumed task's budget
    counts it)."""
    from tests.conftest import wait_for

    model, ledger = script([{"say": "slow thoughts", "sleep": 3, "tool_calls": []}])
    task_id = charlie.submit("canceled mid-call", model=model, task_id=tid())
    wait_for(lambda: model_calls(ledger))  # the model call is under way
    charlie.cancel(task_id)
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.CANCELED
    info = wait_for(lambda: (i := charlie.get_task(task_id)).usage["output_tokens"] and i, 30)
    assert info.status is TaskStatus.CANCELED  # the usage moved no status
    assert info.usage["output_tokens"] > 0 and info.model_calls == 1
