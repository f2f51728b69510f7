"""A task's priority at the broker (submit(priority=...)): its messages wait in the broker's
priority levels, so a task submitted behind a backlog starts before it (docs/models/limits.md,
Priorities at the broker). Through real workers, on Redis, and on RabbitMQ with its tick queue
declared with x-max-priority (CHARLIE_TEST_RABBITMQ_MAX_PRIORITY, on a vhost of the test's
own); the embedded broker has no priorities, and there the same work only has to run."""

from __future__ import annotations

from typing import Any

import pytest

import charlie
from charlie.config import settings
from charlie.domain import TaskStatus
from tests.support.cluster import Backend, Cluster

pytestmark = pytest.mark.timeout(240)

#: how many tasks wait ahead of the urgent one
BACKLOG = 6


def _orders_at_the_broker(backend: Backend) -> str | None:
    """Why this backend cannot show the order, or None."""
    url = backend.broker_url or ""
    if url.startswith("redis"):
        if settings().redis_priorities:
            return None
        return (
            "Redis orders messages by priority only with CHARLIE_REDIS_PRIORITIES=1: set "
            "CHARLIE_TEST_REDIS_PRIORITIES=1"
        )
    if url.startswith("amqp"):
        if settings().rabbitmq_max_priority:
            return None
        return (
            "RabbitMQ orders messages by priority only with CHARLIE_RABBITMQ_MAX_PRIORITY: set "
            "CHARLIE_TEST_RABBITMQ_MAX_PRIORITY=10, on a vhost whose charlie queue has none yet"
        )
    return "the embedded broker has no message priorities"


def _tool_turn(script: Any, label: str) -> str:
    """A task of two turns: a tool call, then an answer (its await tick and its next model
    call are messages of their own too, with CHARLIE_INLINE_PHASES=0)."""
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "e", "name": "echo_number", "arguments": {"value": 1}},
                ]
            },
            {"say": f"{label} done"},
        ]
    )
    return model


def test_a_higher_priority_task_starts_before_the_backlog(
    cluster: Cluster, backend: Backend, script: Any
) -> None:
    # The workers are stopped while a backlog of default-priority tasks and then one urgent
    # task are submitted: their first ticks wait in the broker. One worker of one process
    # then takes them one at a time: the urgent task's first tick, submitted last, is taken
    # first where the broker orders by priority (FIFO, it would start last).
    why_not = _orders_at_the_broker(backend)
    with cluster.without_workers():
        backlog = [
            charlie.submit(f"backlog {i}", model=_tool_turn(script, f"backlog {i}"))
            for i in range(BACKLOG)
        ]
        urgent = charlie.submit("urgent", model=_tool_turn(script, "urgent"), priority=10)
        cluster.start_worker(concurrency=1)
        for task_id in [*backlog, urgent]:
            info = charlie.wait(task_id, timeout=120)
            assert info.status is TaskStatus.SUCCEEDED, (task_id, info.error)
    started = {t: charlie.get_task(t).started_at for t in [*backlog, urgent]}
    assert all(started.values()), started
    if why_not is not None:
        pytest.skip(f"ran, order not checked: {why_not}")
    first = min(started, key=lambda t: started[t])  # type: ignore[arg-type,return-value]
    assert first == urgent, sorted(started.items(), key=lambda kv: kv[1])  # type: ignore[arg-type,return-value]


def test_a_lower_priority_task_waits_behind_the_default(
    cluster: Cluster, backend: Backend, script: Any
) -> None:
    # The other way: work submitted below the default priority, then default work, which
    # starts first where the broker orders by priority.
    why_not = _orders_at_the_broker(backend)
    with cluster.without_workers():
        background = [
            charlie.submit(f"background {i}", model=_tool_turn(script, "bg"), priority=-10)
            for i in range(3)
        ]
        normal = charlie.submit("normal", model=_tool_turn(script, "normal"))
        cluster.start_worker(concurrency=1)
        for task_id in [*background, normal]:
            info = charlie.wait(task_id, timeout=120)
            assert info.status is TaskStatus.SUCCEEDED, (task_id, info.error)
    started = {t: charlie.get_task(t).started_at for t in [*background, normal]}
    if why_not is not None:
        pytest.skip(f"ran, order not checked: {why_not}")
    first = min(started, key=lambda t: started[t])  # type: ignore[arg-type,return-value]
    assert first == normal, sorted(started.items(), key=lambda kv: kv[1])  # type: ignore[arg-type,return-value]


def test_every_message_of_a_run_carries_its_priority(
    cluster: Cluster, backend: Backend, script: Any
) -> None:
    # Every step published (CHARLIE_INLINE_PHASES=0): the urgent task's later ticks, its tool
    # invocation and the await tick its settled call publishes (Celery passes the
    # invocation's priority on, task_inherit_parent_priority) each go ahead of the backlog's
    # first ticks, so the whole urgent task ends before any of the backlog starts.
    why_not = _orders_at_the_broker(backend)
    with cluster.without_workers():
        backlog = [
            charlie.submit(f"backlog {i}", model=_tool_turn(script, f"backlog {i}"))
            for i in range(BACKLOG)
        ]
        urgent = charlie.submit("urgent", model=_tool_turn(script, "urgent"), priority=10)
        cluster.start_worker(concurrency=1, env={"CHARLIE_INLINE_PHASES": "0"})
        for task_id in [*backlog, urgent]:
            info = charlie.wait(task_id, timeout=120)
            assert info.status is TaskStatus.SUCCEEDED, (task_id, info.error)
    ended = charlie.get_task(urgent).finished_at
    started = [charlie.get_task(t).started_at for t in backlog]
    if why_not is not None:
        pytest.skip(f"ran, order not checked: {why_not}")
    assert ended is not None and all(started)
    assert ended < min(s for s in started if s is not None), (ended, sorted(started))  # type: ignore[type-var]


def test_a_worker_declaring_another_max_priority_says_what_to_do(
    cluster: Cluster, backend: Backend
) -> None:
    # RabbitMQ refuses to declare the tick queue with another x-max-priority than it has
    # (PRECONDITION_FAILED): a worker started so stops before it consumes anything, naming
    # the setting and the way to change it, instead of failing its connection over and over.
    have = settings().rabbitmq_max_priority
    if not (backend.broker_url or "").startswith("amqp") or not have:
        pytest.skip(_orders_at_the_broker(backend) or "RabbitMQ only")
    other = str(have - 1 if have > 1 else have + 1)
    with cluster.without_workers():
        worker = cluster.start_worker(concurrency=1, env={"CHARLIE_RABBITMQ_MAX_PRIORITY": other})
        assert worker.wait(timeout=60) != 0
    logs = cluster.logs()
    assert "PRECONDITION_FAILED" in logs and "CHARLIE_RABBITMQ_MAX_PRIORITY" in logs, logs
    assert "delete the queue ('charlie'" in logs, logs
