"""Provider limits the whole fleet keeps (CHARLIE_MODEL_LIMITS; I30), through real workers
against a real HTTP server on 127.0.0.1 that enforces an account's limits as OpenAI does: a
request over them is refused with 429 and retry-after (tests/support/fake_openai.py,
ProviderLimit)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

import charlie
from charlie.domain import TaskStatus, utcnow
from tests.conftest import wait_for
from tests.support.cluster import Cluster
from tests.support.fake_openai import (
    FakeOpenAI,
    ProviderLimit,
    Recorded,
    Reply,
    chat_stream,
    chat_text,
    chat_tool_calls,
    usage_chat,
)

pytestmark = pytest.mark.timeout(240)

MODEL = "openai:fake-model"


def prompt_of(recorded: Recorded) -> str:
    """The task's prompt: the first user message of the request."""
    messages = recorded.body["messages"]
    return str(next(m["content"] for m in messages if m["role"] == "user"))


def answer(tokens: int = 15, hold: dict[str, float] | None = None) -> Callable[[Recorded], Reply]:
    """A final answer to any request, ``tokens`` of usage; a prompt in ``hold`` is answered
    after that many seconds (its first request only)."""
    held = dict(hold or {})

    def reply(recorded: Recorded) -> Reply:
        delay = held.pop(prompt_of(recorded), 0.0)
        return Reply(
            200,
            chat_text("done", usage=usage_chat(tokens - 5, 5)).body,
            delay=delay,
        )

    return reply


@contextmanager
def limited(cluster: Cluster, table: dict[str, Any]) -> Iterator[Cluster]:
    with cluster.configured(CHARLIE_MODEL_LIMITS=json.dumps(table)) as limited_cluster:
        yield limited_cluster


def wait_all(task_ids: list[str], timeout: float = 120) -> None:
    for task_id in task_ids:
        info = charlie.wait(task_id, timeout=timeout)
        assert info.status is TaskStatus.SUCCEEDED, (task_id, info.error)


def arrivals(limit: ProviderLimit, prefix: str) -> list[float]:
    return [at for at, r in limit.admitted if prompt_of(r).startswith(prefix)]


def test_a_concurrency_limit_is_kept_by_the_whole_fleet(
    cluster: Cluster, model_server: FakeOpenAI
) -> None:
    # Two workers of two processes each against an account that allows 2 in flight: without
    # the fleet's limit they send 4 at once and draw refusals.
    limit = ProviderLimit(concurrency=2, retry_after="1", latency=0.3, answer=answer())
    model_server.limit = limit
    with limited(cluster, {"openai:": {"concurrency": 2}}):
        ids = [charlie.submit(f"job {i}", model=MODEL) for i in range(12)]
        wait_all(ids)
    assert limit.refusals == 0
    assert limit.peak == 2
    assert len(limit.admitted) == 12
    assert len(model_server.requests) == 12


def test_requests_and_tokens_per_minute_hold_calls_for_the_minute(
    cluster: Cluster, model_server: FakeOpenAI
) -> None:
    # rpm: 3 requests a minute. tpm: 2,500 tokens a minute, requests of different sizes by
    # their size before they are sent (a prompt and one small tool), each 1,000 by the usage
    # the provider reports: "tpm a" (about 1,050) goes; "tpm b" (about 2,150) would pass the
    # limit and waits for the minute; "tpm c" (about 650), submitted while b waits, fits but
    # goes after b, in line order (I30), not past it as a stream of small calls would (and
    # not beside it: with b's estimate it would pass the limit, so it goes once b's answer
    # has corrected b's count).
    limit = ProviderLimit(rpm=6, retry_after="5", answer=answer(tokens=1000))
    model_server.limit = limit
    table = {"openai:fake-rpm": {"rpm": 3}, "openai:fake-tpm": {"tpm": 2500}}

    def tpm_call(name: str, size: int) -> str:
        prompt = f"tpm {name} " + "x" * size
        return charlie.submit(prompt, model="openai:fake-tpm", tools=["echo_number"])

    with limited(cluster, table):
        ids = [charlie.submit(f"rpm {i}", model="openai:fake-rpm") for i in range(4)]
        ids.append(tpm_call("a", 4000))
        wait_for(lambda: arrivals(limit, "tpm a"), timeout=60)
        ids.append(tpm_call("b", 8400))
        wait_for(lambda: charlie.get_task(ids[-1]).capacity is not None, timeout=60)
        ids.append(tpm_call("c", 2400))
        wait_all(ids, timeout=150)
    assert limit.refusals == 0
    rpm = sorted(arrivals(limit, "rpm"))
    assert len(rpm) == 4
    # the first ones at once, the next a minute after the first
    assert rpm[2] - rpm[0] < 20 and rpm[3] - rpm[0] >= 59, rpm
    tpm = [(at, prompt_of(r)[:5]) for at, r in limit.admitted if prompt_of(r).startswith("tpm")]
    assert [name for _, name in tpm] == ["tpm a", "tpm b", "tpm c"], tpm
    assert tpm[1][0] - tpm[0][0] >= 59, tpm


def test_a_429_with_retry_after_pauses_every_caller_of_the_limit(
    cluster: Cluster, model_server: FakeOpenAI
) -> None:
    # The provider refuses one request for its own reasons, asking for 3 s: no other caller
    # of the limit sends anything before they have passed (not only the refused call waits).
    limit = ProviderLimit(retry_after="3", latency=0.05, answer=answer(), refuse_next=1)
    model_server.limit = limit
    with limited(cluster, {"openai:": {"concurrency": 8}}):
        first = charlie.submit("first", model=MODEL)
        wait_for(lambda: limit.refused_at, timeout=60)
        others = [charlie.submit(f"other {i}", model=MODEL) for i in range(3)]
        wait_all([first, *others])
    refused = limit.refused_at[0]
    sent = arrivals(limit, "other")
    assert len(sent) == 3
    assert min(sent) >= refused + 2.5, (refused, sent)
    assert limit.refusals == 1


def _waiting(count: int) -> Callable[[], bool]:
    from sqlalchemy import func, select

    from charlie.runtime import get_producer
    from charlie.store.engine import read
    from charlie.store.schema import limit_waiters

    def check() -> bool:
        with read(get_producer().engine) as conn:
            waiting = conn.execute(select(func.count()).select_from(limit_waiters)).scalar_one()
        return bool(waiting >= count)

    return check


#: the cluster's lease (tests/support/cluster.py, CHARLIE_LEASE_SECONDS)
LEASE_SECONDS = 2.0


def _run_row(task_id: str) -> Any:
    from sqlalchemy import select

    from charlie.runtime import get_producer
    from charlie.store.engine import read
    from charlie.store.schema import executions

    with read(get_producer().engine) as conn:
        return conn.execute(select(executions).where(executions.c.task_id == task_id)).one()


def _lease_until(task_id: str) -> datetime | None:
    value = _run_row(task_id).lease_until
    if value is None:
        return None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _live_slots(task_id: str) -> int:
    """The slots of the task's run that count as in flight now (store.limits._live_slot)."""
    from sqlalchemy import func, select

    from charlie.runtime import get_producer
    from charlie.store.engine import read
    from charlie.store.schema import executions, limit_slots

    s, e = limit_slots.c, executions.c
    with read(get_producer().engine) as conn:
        return int(
            conn.execute(
                select(func.count())
                .select_from(limit_slots.join(executions, e.id == s.execution_id))
                .where(
                    e.task_id == task_id,
                    s.released_at.is_(None),
                    e.version == s.version,
                    e.attempts == s.attempt,
                    e.lease_until > utcnow(),
                )
            ).scalar_one()
        )


def _clear_waiters() -> None:
    from sqlalchemy import delete

    from charlie.runtime import get_producer
    from charlie.store.engine import write
    from charlie.store.schema import limit_waiters

    with write(get_producer().engine) as conn:
        conn.execute(delete(limit_waiters))


def test_a_higher_priority_call_goes_before_those_waiting_longer(
    cluster: Cluster, model_server: FakeOpenAI
) -> None:
    _clear_waiters()
    limit = ProviderLimit(concurrency=1, latency=0.1, answer=answer(hold={"blocker": 4.0}))
    model_server.limit = limit
    with limited(cluster, {"openai:": {"concurrency": 1}}):
        blocker = charlie.submit("blocker", model=MODEL)
        wait_for(lambda: limit.admitted, timeout=60)
        lows = [charlie.submit(f"low {i}", model=MODEL) for i in range(3)]
        wait_for(_waiting(3), timeout=30)
        # What `charlie status` and the console say of a waiting call (docs/models/limits.md).
        # A waiter's row is committed before its run's wait transition, which records what it
        # waits for: wait for that transition, not only the row.
        wait_for(lambda: charlie.get_task(lows[-1]).capacity is not None, timeout=30)
        shown = charlie.get_task(lows[-1]).capacity
        assert shown is not None and shown.startswith(
            "waiting for capacity on openai: (1 in flight, "
        ), shown
        high = charlie.submit("high", model=MODEL, priority=10)
        wait_all([blocker, high, *lows])
    order = [prompt_of(r) for _, r in limit.admitted]
    assert order[0] == "blocker"
    assert order[1] == "high", order
    assert limit.refusals == 0


def test_a_busy_task_does_not_starve_the_others(cluster: Cluster, model_server: FakeOpenAI) -> None:
    # One task calls its model turn after turn; three single-call tasks submitted after its
    # first call go in their turn, not after all of the busy task's calls (fair order).
    def busy_or_done(recorded: Recorded) -> Reply:
        prompt = prompt_of(recorded)
        turns = sum(1 for m in recorded.body["messages"] if m["role"] == "tool")
        if prompt == "busy" and turns < 6:
            return chat_tool_calls([(f"c{turns}", "echo_number", '{"value": 1}')])
        delay = 1.0 if prompt == "busy" and turns == 0 else 0.0
        return Reply(200, chat_text("done").body, delay=delay)

    def busy_first_slow(recorded: Recorded) -> Reply:
        reply = busy_or_done(recorded)
        if prompt_of(recorded) == "busy" and len(limit.admitted) == 1:
            reply.delay = 1.5
        return reply

    limit = ProviderLimit(concurrency=1, latency=0.05, answer=busy_first_slow)
    model_server.limit = limit
    with limited(cluster, {"openai:": {"concurrency": 1}}):
        busy = charlie.submit("busy", model=MODEL, tools=["echo_number"])
        wait_for(lambda: limit.admitted, timeout=60)
        singles = [charlie.submit(f"single {i}", model=MODEL) for i in range(3)]
        wait_all([busy, *singles])
    order = [prompt_of(r) for _, r in limit.admitted]
    assert order.count("busy") == 7
    last_single = max(i for i, p in enumerate(order) if p.startswith("single"))
    # each single waited behind at most one more call of the busy task
    assert order[: last_single + 1].count("busy") <= 4, order
    assert limit.refusals == 0


def test_a_worker_killed_while_it_holds_a_slot_gives_it_back(
    cluster: Cluster, model_server: FakeOpenAI
) -> None:
    # I30: the slot of a SIGKILLed holder lapses with its lease (and its run, claimed again,
    # counts its attempt anew): the task waiting behind it goes on. The holder is canceled
    # meanwhile, so nothing of it ever releases the slot: only its lease gives it back.
    _clear_waiters()
    limit = ProviderLimit(latency=0.05, answer=answer(hold={"holder": 60.0}))
    model_server.limit = limit
    with limited(cluster, {"openai:": {"concurrency": 1}}):
        holder = charlie.submit("holder", model=MODEL)
        wait_for(lambda: limit.admitted, timeout=60)
        behind = charlie.submit("behind", model=MODEL)
        wait_for(_waiting(1), timeout=30)
        with cluster._lock:  # no worker restarted (and renewing a lease) before all are dead
            for worker in list(cluster.alive_workers()):
                cluster.kill(worker)
        killed_at = utcnow()
        # The slot comes back within a lease from the kill: the lease its holder's run had
        # then (renewed by a live worker only) ends by then, and with it the slot's count.
        lease_until = _lease_until(holder)
        assert lease_until is not None
        assert lease_until <= killed_at + timedelta(seconds=LEASE_SECONDS), (
            lease_until,
            killed_at,
        )
        wait_for(lambda: utcnow() > lease_until, timeout=LEASE_SECONDS + 5)
        assert _live_slots(holder) == 0
        charlie.cancel(holder)
        cluster.ensure(workers=2)
        wait_all([behind])
        assert charlie.wait(holder, timeout=60).status is TaskStatus.CANCELED
    order = [prompt_of(r) for _, r in limit.admitted]
    assert order == ["holder", "behind"], order
    from charlie.runtime import get_producer
    from charlie.store import limits
    from charlie.store.engine import read

    with read(get_producer().engine) as conn:
        found = limits.statuses(conn, utcnow())
    (status,) = [s for s in found if s.key == "openai:"]
    assert status.in_flight == 0


#: the last tests' limits, in one configuration of the workers (each configuration restarts
#: them): "openai:fake-paused" for the repeat that waits, "openai:" held by one call; the
#: model timeout longer than the session's, for a call held longer
LAST_TABLE = {"openai:fake-paused": {"concurrency": 4}, "openai:": {"concurrency": 1}}


@pytest.fixture(scope="module")
def last_limits(cluster_session: Cluster) -> Iterator[Cluster]:
    with cluster_session.configured(
        CHARLIE_MODEL_LIMITS=json.dumps(LAST_TABLE), CHARLIE_MODEL_TIMEOUT="180"
    ) as configured:
        yield configured


def _pause(key: str, seconds: float, task_id: str | None = None) -> None:
    """The limit paused as a provider's 429 pauses it (every caller waits until then); with
    ``task_id``, that task's run woken too (a pause lifted early)."""
    from datetime import timedelta

    from sqlalchemy import update

    from charlie.domain import utcnow
    from charlie.runtime import get_producer
    from charlie.store import limits
    from charlie.store.engine import write
    from charlie.store.schema import executions, limit_state

    now = utcnow()
    with write(get_producer().engine) as conn:
        limits.lock_limit(conn, key)
        conn.execute(
            update(limit_state)
            .where(limit_state.c.limit_key == key)
            .values(paused_until=now + timedelta(seconds=seconds))
        )
        if task_id is not None:
            conn.execute(
                update(executions).where(executions.c.task_id == task_id).values(wake_at=now)
            )


def test_a_repeat_that_waits_for_capacity_streams_anew_and_counts_as_a_repeat(
    last_limits: Cluster, cluster: Cluster, model_server: FakeOpenAI
) -> None:
    """I3: a worker SIGKILLed mid-stream; the call's repeat first waits for capacity (the
    provider paused the limit), a wait that ends with the claim's attempt count reset. The
    repeat still streams under a name of its own (not the killed attempt's, which watchers
    saw abandoned) and is counted as the one repeat it is."""
    spec = "openai:fake-paused"
    partial = "This first attempt dies with its worker"
    cut_short = chat_stream(partial, hold_at=4, hold_seconds=60)
    model_server.enqueue(cut_short, chat_text("done after the pause"))
    task_id = charlie.submit("repeat after a pause", model=spec)
    try:
        for event in charlie.events(task_id, timeout=150):
            if event.type == "text":
                # Paused from before the kill until the repeat's claim has seen it.
                _pause(spec, 120)
                with cluster._lock:
                    for proc in cluster.alive_workers():
                        cluster.kill(proc)
                break
        # the repeat waits for capacity
        wait_for(lambda: charlie.get_task(task_id).capacity is not None, timeout=60)
        _pause(spec, 0, task_id)
    finally:
        cut_short.release.set()
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    seen = list(charlie.events(task_id, timeout=30))
    started = [e.data["call"] for e in seen if e.type == "model_start"]
    assert len(started) == 2 and len(set(started)) == 2, started
    ended = [(e.data["call"], e.data.get("status")) for e in seen if e.type == "model_end"]
    assert (started[0], "abandoned") in ended and (started[1], "completed") in ended, ended
    assert info.model_repeats == 1
    assert len(model_server.requests) == 2


def test_a_call_waiting_for_capacity_holds_no_lease_and_no_worker(
    last_limits: Cluster, cluster: Cluster, model_server: FakeOpenAI, script: Any
) -> None:
    """I30's first clause: a call waiting for capacity waits as a stored wake-up, its run's
    lease released (no lease_owner, no lease_until) and no worker taken: with more calls
    waiting than the workers have processes, a task of another model still runs through."""
    _clear_waiters()
    blocking = chat_stream("held", hold_at=2, hold_seconds=150)

    def hold_the_blocker(recorded: Recorded) -> Reply:
        if prompt_of(recorded) == "blocker":
            return blocking
        return Reply(200, chat_text("done").body)

    limit = ProviderLimit(latency=0.05, answer=hold_the_blocker)
    model_server.limit = limit
    # (the blocker's call is held longer than the session's model timeout allows)
    try:
        blocker = charlie.submit("blocker", model=MODEL)
        wait_for(lambda: limit.admitted, timeout=60)
        # 2 workers of 2 processes: more waiting calls than processes
        waiting = [charlie.submit(f"waiting {i}", model=MODEL) for i in range(5)]
        wait_for(_waiting(5), timeout=60)
        for task_id in waiting:
            wait_for(lambda t=task_id: charlie.get_task(t).capacity is not None, timeout=60)

        # A waiting run's wait is committed with its lease released (a run holds one only
        # for a moment when it looks again, in a tick of its own).
        def released(task_id: str) -> bool:
            row = _run_row(task_id)
            assert row.phase == "call_model", row
            return row.lease_owner is None and row.lease_until is None and bool(row.wake_at)

        wait_for(lambda: all(released(t) for t in waiting), timeout=30)
        other_model, _ = script([{"say": "not held back"}])
        other = charlie.submit("another model", model=other_model)
        info = charlie.wait(other, timeout=90)
        assert info.status is TaskStatus.SUCCEEDED, info.error
        # ...while they all still wait, the blocker still holding the one slot
        assert [prompt_of(r) for _, r in limit.admitted] == ["blocker"]
        assert all(charlie.get_task(t).capacity is not None for t in waiting)
    finally:
        blocking.release.set()
    wait_all([blocker, *waiting])
    assert limit.refusals == 0
