"""Whole runs through the executor with ``anthropic:NAME`` (the official SDK, streamed), the
cluster's workers calling a real HTTP server on 127.0.0.1 that speaks the Messages API
(tests/support/fake_anthropic.py; the workers get ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

import charlie
from charlie.domain import TaskStatus
from charlie.runtime import get_producer
from charlie.store.engine import read
from charlie.store.schema import Base, executions
from tests.conftest import wait_for
from tests.integration.test_loop import assert_every_call_has_one_result
from tests.support.cluster import Cluster
from tests.support.fake_anthropic import (
    FAKE_ANTHROPIC_KEY,
    FakeAnthropic,
    error,
    message,
    overloaded,
    rate_limited,
    redacted_thinking,
    text,
    thinking,
    tool_use,
    usage,
)

pytestmark = pytest.mark.timeout(120)


def everything_stored() -> str:
    """Every row of every table, as text: where a leaked key would be."""
    rows: list[Any] = []
    with read(get_producer().engine) as conn:
        for table in Base.metadata.sorted_tables:
            rows.extend(dict(r._mapping) for r in conn.execute(select(table)))
    return json.dumps(rows, default=str)


def assert_key_kept(cluster: Cluster) -> None:
    """The key went over the wire and nowhere else: not in the database (tasks, transcript,
    calls, evidence, transitions), not in the workers' logs."""
    assert FAKE_ANTHROPIC_KEY not in everything_stored()
    for log in cluster.home.glob("*.log"):
        assert FAKE_ANTHROPIC_KEY not in log.read_text(errors="replace"), log


def test_a_tool_loop_with_thinking_and_parallel_calls_runs_to_its_answer(
    cluster: Cluster, anthropic_server: FakeAnthropic, workspace: Path
) -> None:
    """I6, I8, I16: the signed thinking blocks of a tool-calling turn go back unchanged in the
    next request (the fake refuses the loop otherwise, as the API does); both parallel calls
    are answered in one user turn, in call order; cache tokens are counted."""
    (workspace / "a.txt").write_text("alpha")
    anthropic_server.enqueue(
        message(
            thinking("Read a.txt and list the files.", "sig-worker-1"),
            redacted_thinking("opaque-worker"),
            text("Looking first."),
            tool_use("toolu_a", "read_file", {"path": "a.txt"}),
            tool_use("toolu_b", "list_files", {}),
            use=usage(300, 40, cache_write=2000, thinking_tokens=12),
        ),
        message(
            text("It says alpha."),
            use=usage(50, 8, cache_read=2000),
        ),
    )
    task_id = charlie.submit(
        "what does a.txt say",
        model="anthropic:claude-fake-thinker",
        metadata={"workspace": str(workspace)},
    )
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.result["answer"] == "It says alpha."
    assert info.usage == {
        "input_tokens": 300 + 2000 + 50 + 2000,
        "output_tokens": 48,
        "reasoning_tokens": 12,
        "cache_read_tokens": 2000,
        "cache_write_tokens": 2000,
    }
    kinds = [i.kind for i in charlie.transcript(task_id)]
    assert kinds[2:] == [
        "reasoning",
        "reasoning",
        "message",
        "tool_call",
        "tool_call",
        "tool_result",
        "tool_result",
        "final",
    ]
    assert_every_call_has_one_result(task_id)

    first, second = anthropic_server.bodies
    assert first["model"] == "claude-fake-thinker"
    assert first["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert {"read_file", "list_files"} <= {t["name"] for t in first["tools"]}
    assistant, answers = second["messages"][1], second["messages"][2]
    assert assistant["content"][:2] == [
        {
            "type": "thinking",
            "thinking": "Read a.txt and list the files.",
            "signature": "sig-worker-1",
        },
        {"type": "redacted_thinking", "data": "opaque-worker"},
    ]
    assert [b["tool_use_id"] for b in answers["content"]] == ["toolu_a", "toolu_b"]
    assert answers["content"][0]["content"] == "alpha"
    assert second["messages"][:1] == [
        {**first["messages"][0], "content": second["messages"][0]["content"]}
    ]
    assert_key_kept(cluster)

    # charlie status shows the cache tokens and prices them at their own rates
    from tests.integration.test_production_path import charlie_cli

    prices = {
        "anthropic:claude-fake-": {"input": 3, "output": 15, "cache_read": 0.3, "cache_write": 3.75}
    }
    env = {**cluster.settings_env, "CHARLIE_PRICES": json.dumps(prices)}
    status = charlie_cli(env, "status", task_id)
    assert status.returncode == 0, status.stderr
    lines = {line.split(None, 1)[0]: line for line in status.stdout.splitlines() if line.strip()}
    assert "cache read 2000, cache write 2000" in lines["tokens"], status.stdout
    # uncached input 350 at 3, read 2000 at 0.3, written 2000 at 3.75, output 48 at 15
    cost = (350 * 3 + 2000 * 0.3 + 2000 * 3.75 + 48 * 15) / 1e6
    assert f"${cost:.4f}" in lines["cost"], status.stdout


def test_overloaded_then_success(cluster: Cluster, anthropic_server: FakeAnthropic) -> None:
    anthropic_server.enqueue(overloaded(retry_after="1"), message(text("made it")))
    task_id = charlie.submit("hello", model="anthropic:claude-fake")
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.result["answer"] == "made it"
    assert len(anthropic_server.requests) == 2
    assert info.model_calls == 1


def test_a_long_retry_after_becomes_a_stored_wake_up(
    cluster: Cluster, anthropic_server: FakeAnthropic
) -> None:
    """A 429 asking for longer than the client sleeps in a call is handed to the executor,
    which stores the wake-up time (no tick sleeps it) and calls again after it."""
    anthropic_server.enqueue(rate_limited(retry_after="6"), message(text("after the wait")))
    task_id = charlie.submit("hello", model="anthropic:claude-fake")

    def waiting() -> Any:
        with read(get_producer().engine) as conn:
            row = conn.execute(
                select(executions.c.wake_at, executions.c.lease_owner, executions.c.state).where(
                    executions.c.task_id == task_id
                )
            ).first()
        return row if row is not None and row.wake_at is not None else None

    stored = wait_for(waiting, timeout=30)
    assert stored.lease_owner is None  # nobody sleeps it in a tick: the sweep wakes the run
    assert "retry in 6.0 s" in stored.state["last_model_error"]
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.result["answer"] == "after the wait"
    assert len(anthropic_server.requests) == 2
    assert_key_kept(cluster)  # the stored error note included


def test_a_400_fails_the_run_with_the_response_as_evidence(
    cluster: Cluster, anthropic_server: FakeAnthropic
) -> None:
    anthropic_server.enqueue(error(400, "invalid_request_error", "messages: too many images"))
    task_id = charlie.submit("hello", model="anthropic:claude-fake")
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.FAILED
    assert "HTTP 400 invalid_request_error" in json.dumps(info.error)
    assert "too many images" in json.dumps(info.error)
    assert len(anthropic_server.requests) == 1
    assert_key_kept(cluster)


def test_a_refusal_fails_the_run_and_is_not_retried(
    cluster: Cluster, anthropic_server: FakeAnthropic
) -> None:
    anthropic_server.enqueue(message(text("I will not do that."), stop_reason="refusal"))
    task_id = charlie.submit("do something bad", model="anthropic:claude-fake")
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.FAILED
    assert "refused" in json.dumps(info.error)
    assert "I will not do that." in json.dumps(info.error)
    assert len(anthropic_server.requests) == 1


def test_max_tokens_fails_the_run_naming_the_setting(
    cluster: Cluster, anthropic_server: FakeAnthropic
) -> None:
    anthropic_server.enqueue(message(text("The long answer begins"), stop_reason="max_tokens"))
    task_id = charlie.submit("write a lot", model="anthropic:claude-fake")
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.FAILED
    assert "CHARLIE_MODEL_CLAUDE_FAKE_MAX_TOKENS" in json.dumps(info.error)
    assert len(anthropic_server.requests) == 1


def test_pause_turn_continues_the_turn(cluster: Cluster, anthropic_server: FakeAnthropic) -> None:
    anthropic_server.enqueue(
        message(text("Working on it."), stop_reason="pause_turn", use=usage(10, 2)),
        message(text("Done."), use=usage(20, 3)),
    )
    task_id = charlie.submit("a long server-side job", model="anthropic:claude-fake")
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.result["answer"] == "Done."
    assert info.model_calls == 1  # one turn, continued within its call
    assert info.usage["input_tokens"] == 30
    second = anthropic_server.bodies[1]["messages"]
    assert second[-1]["role"] == "assistant"
    assert second[-1]["content"] == [{"type": "text", "text": "Working on it."}]
