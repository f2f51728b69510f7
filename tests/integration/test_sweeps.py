"""Sweeps: two beats at once must not act twice on one row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, select, update

from charlie import scheduler
from charlie.domain import CallState, Phase
from charlie.store.engine import get_engine, upgrade, write
from charlie.store.schema import executions, tool_calls
from tests.support.cluster import REPO, Backend, recreate_postgres_database

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def private_database(backend: Backend, tmp_path: Path) -> str:
    """A database of the backend under test that the cluster's own beat does not sweep."""
    if backend.database_url and backend.database_url.startswith("postgresql"):
        url = backend.database_url.rsplit("/", 1)[0] + "/charlie_test_beats"
        recreate_postgres_database(url)
    else:
        url = f"sqlite:///{tmp_path / 'beats.db'}"
    # The database was just recreated under this process's pool, whose connections (kept
    # warm, so not pinged) the drop terminated.
    get_engine(url).dispose()
    upgrade(url)
    return url


def stalled_run(engine: Engine, prefix: str, since: datetime, **values: object) -> str:
    """Submit a task whose run has not moved since ``since`` (with ``values`` set on its row)."""
    submitted = scheduler.submit(
        engine,
        prompt="p",
        model="scripted:/x.json",
        tools=None,
        task_id=f"{prefix}-{uuid.uuid4().hex[:8]}",
        timeout=None,
        metadata=None,
    )
    with write(engine) as conn:
        conn.execute(
            update(executions)
            .where(executions.c.id == submitted.execution_id)
            .values(updated_at=since, **values)
        )
    return submitted.execution_id


def test_two_beats_at_once_act_once_per_row(private_database: str) -> None:
    engine = get_engine(private_database)
    long_ago = datetime.now(UTC) - timedelta(minutes=5)
    runs, calls = [], []
    for n in range(20):
        # A run whose tick was lost long ago, holding one call whose worker died.
        execution_id = stalled_run(
            engine,
            "beats",
            long_ago,
            phase=Phase.AWAIT_TOOLS.value if n % 2 else Phase.CALL_MODEL.value,
        )
        runs.append(execution_id)
        with write(engine) as conn:
            conn.execute(
                tool_calls.insert().values(
                    execution_id=execution_id,
                    call_id=f"c{n}",
                    turn=0,
                    idx=0,
                    name="ledger_write",
                    arguments={"key": "k"},
                    effect="write",
                    resumable=False,
                    state=CallState.STARTED.value,
                    queued_at=long_ago,
                    started_at=long_ago,
                    started_by="dead-worker",
                    lease_owner="dead-worker",
                    lease_until=long_ago,
                    attempts=1,
                    late_reports=0,
                )
            )
            calls.append((execution_id, f"c{n}"))
    env = {**os.environ, "CHARLIE_DATABASE_URL": private_database}
    start_at = time.time() + 3
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.sweeper", str(start_at), str(i)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    interrupted = sum(o["calls"]["interrupted"] for o in outputs)
    assert interrupted == len(calls)  # every dead call settled, once
    ticks = Counter(tuple(s[1:]) for o in outputs for s in o["sent"] if s[0] == "tick")
    assert all(n == 1 for n in ticks.values()), ticks
    assert {t[0] for t in ticks} >= {r for i, r in enumerate(runs) if i % 2 == 0}
    with engine.connect() as conn:
        rows = conn.execute(select(tool_calls.c.outcome, tool_calls.c.settled_by)).all()
    assert all(r.outcome == "interrupted" for r in rows)
    # Both sweepers really ran, each settled only the rows it won.
    assert {r.settled_by.split("@")[1] for r in rows} <= {"sweeper-0", "sweeper-1"}


def test_a_backlog_is_not_mistaken_for_lost_ticks(
    private_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """I4 without a feedback loop: while the broker queue is deep, runs that only look stalled
    (their ticks are queued) are not re-published; once it drains they are. A run stalled past
    CHARLIE_SWEEP_BACKLOG_MAX_WAIT is re-published even in a backlog (a tick
    really lost meanwhile waits that long at most), once per that period. Every re-published
    tick is durable (its worker commits the claim and the attempt first), so the sweep itself
    counts no attempt: a tick that only waited in the queue is not taken for poison."""
    from charlie import sweeps
    from charlie.config import load_settings
    from charlie.runtime import Runtime
    from charlie.testing import RecordingPublisher
    from charlie.tools.registry import REGISTRY

    engine = get_engine(private_database)
    settings = load_settings()
    max_wait = timedelta(seconds=settings.sweep_backlog_max_wait)
    recent = datetime.now(UTC) - max_wait / 2  # stalled, but within the backlog's patience
    long_ago = datetime.now(UTC) - max_wait * 2
    waiting = [stalled_run(engine, "backlog", recent) for _ in range(5)]
    lost = [stalled_run(engine, "backlog-lost", long_ago) for _ in range(2)]
    publisher = RecordingPublisher()
    rt = Runtime(
        settings=settings,
        engine=engine,
        worker="sweeper-test",
        publisher=publisher,  # type: ignore[arg-type]
        tools=REGISTRY,
    )
    monkeypatch.setattr(sweeps, "queue_depth", lambda queue="charlie": 10_000)
    assert sweeps.sweep_stalled_runs(rt) == 2
    assert sorted(m[1] for m in publisher.sent) == sorted(lost)
    assert sweeps.sweep_stalled_runs(rt) == 0  # once per max-wait period, not every round
    monkeypatch.setattr(sweeps, "queue_depth", lambda queue="charlie": 0)
    assert sweeps.sweep_stalled_runs(rt) == 5  # drained: the rest go too
    assert {m[1] for m in publisher.sent} == set(waiting + lost)
    assert all(m[4] is True for m in publisher.sent)  # durable: the claim counts the attempt

    def attempts() -> list[int]:
        with engine.connect() as conn:
            rows = conn.execute(select(executions.c.attempts).where(executions.c.id.in_(waiting)))
            return [r.attempts for r in rows]

    with write(engine) as conn:  # the stall period passes and nothing moved
        conn.execute(
            update(executions).where(executions.c.id.in_(waiting)).values(swept_at=long_ago)
        )
    assert sweeps.sweep_stalled_runs(rt) == 5
    assert attempts() == [0] * 5  # a queued tick is not counted as a dying one


def test_the_late_watch_looks_only_at_overdue_waits_in_its_window(private_database: str) -> None:
    """I13: the late watch observes resumable waits that their deadline settled, that have a
    handle on outside work, whose end is not yet reported, settled within the watch's window
    and not looked at this stall period; nothing else."""
    from charlie.store.calls import overdue_waits

    engine = get_engine(private_database)
    now = datetime.now(UTC)
    execution_id = stalled_run(engine, "watch", now)

    def settled_call(call_id: str, **values: object) -> None:
        row: dict[str, object] = {
            "execution_id": execution_id,
            "call_id": call_id,
            "turn": 0,
            "idx": 0,
            "name": "wait_for_file",
            "arguments": {"path": "p"},
            "effect": "wait",
            "resumable": True,
            "state": CallState.SETTLED.value,
            "outcome": "deadline_exceeded",
            "handle": "outside-work",
            "settled_at": now - timedelta(minutes=1),
            "attempts": 1,
            "late_reports": 0,
        }
        with write(engine) as conn:
            conn.execute(tool_calls.insert().values(**{**row, **values}))

    settled_call("watched")
    settled_call("looked-at-last-period", swept_at=now - timedelta(seconds=30))
    settled_call("looked-at-just-now", swept_at=now - timedelta(seconds=1))
    settled_call("before-the-window", settled_at=now - timedelta(hours=2))
    settled_call("reported", late_reports=1, late_result={"outcome": "ok", "result": 1})
    settled_call("not-a-wait", name="sleep_then", effect="read", resumable=False)
    settled_call("no-handle", handle=None)
    settled_call("finished-in-time", outcome="ok")
    settled_call("still-open", state=CallState.STARTED.value, outcome=None, settled_at=None)
    with engine.connect() as conn:
        found = overdue_waits(conn, now - timedelta(hours=1), now - timedelta(seconds=5), 100)
    assert sorted(r.call_id for r in found) == ["looked-at-last-period", "watched"]


def test_open_calls_of_an_ended_run_settle_canceled_and_live_ones_stay_open(cluster) -> None:
    """A call in flight left on a run that has ended (its run `done`: queued for a worker that
    never took it) settles `canceled` by the tool-call sweep, so it still has its one outcome;
    an open call of a live run (held for an approval), and a call already settled, are left as
    they are (I8, I12). The scan is driven from the calls in flight (store/scans.py
    abandoned_calls); a held call cannot outlive its run (see the next test)."""
    from sqlalchemy import insert

    from charlie.domain import execution_id_for
    from charlie.runtime import get_runtime
    from charlie.store.engine import read
    from charlie.store.schema import tasks
    from tests.conftest import wait_for

    engine = get_runtime().engine
    now = datetime.now(UTC)
    tag = uuid.uuid4().hex[:8]
    rows = {
        "ended": ("succeeded", Phase.DONE.value, CallState.PENDING.value),
        "live": ("waiting", Phase.AWAIT_TOOLS.value, CallState.PENDING.value),
        "settled": ("succeeded", Phase.DONE.value, CallState.SETTLED.value),
    }
    with write(engine) as conn:
        for name, (status, phase, state) in rows.items():
            task_id = f"abandoned-{name}-{tag}"
            conn.execute(
                insert(tasks),
                {
                    "id": task_id,
                    "prompt": "rows only",
                    "model": "scripted:none.json",
                    "metadata": {},
                    "status": status,
                    "created_at": now,
                },
            )
            conn.execute(
                insert(executions),
                {
                    "id": execution_id_for(task_id),
                    "task_id": task_id,
                    "phase": phase,
                    "version": 3,
                    "state": {},
                    "turn": 1,
                    "next_seq": 2,
                    "updated_at": now + timedelta(hours=1),  # not a stalled run
                    "created_at": now,
                },
            )
            settled = state == CallState.SETTLED.value
            conn.execute(
                insert(tool_calls),
                {
                    "execution_id": execution_id_for(task_id),
                    "call_id": "c0",
                    "turn": 1,
                    "idx": 0,
                    "name": "ledger_write",
                    "arguments": {"key": name},
                    "effect": "write",
                    "state": state,
                    # the live run's waits for a person; the ended run's was queued for a
                    # worker (an invoke on its way when the run ended)
                    "hold": "approval" if name == "live" else None,
                    "queued_at": None if settled else now,
                    "outcome": "ok" if settled else None,
                },
            )

    def call(name: str) -> tuple[str, str | None]:
        with read(engine) as conn:
            row = conn.execute(
                select(tool_calls.c.state, tool_calls.c.outcome).where(
                    tool_calls.c.execution_id == execution_id_for(f"abandoned-{name}-{tag}")
                )
            ).one()
        return row.state, row.outcome

    wait_for(lambda: call("ended") == (CallState.SETTLED.value, "canceled"), timeout=30)
    cluster.sweep_rounds(2)  # a round begun after the first call settled: it left these
    assert call("live") == (CallState.PENDING.value, None)
    assert call("settled") == (CallState.SETTLED.value, "ok")


def test_a_settled_turn_with_no_wake_up_is_found_by_the_probe_only_when_it_is_due(
    private_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """I4, I7: a run in await_tools whose calls have all settled and that has no wake-up (a
    worker of a release before migration 0016 settled it; a move into await_tools whose publish
    was lost) is not read by a round's scans, which skip the runs that wait: the probe of the
    runs in await_tools finds it, on a process's first round and then every
    CHARLIE_SWEEP_PROBE_SECONDS; a run whose turn is still open is never taken."""
    from dataclasses import replace

    from charlie.config import load_settings
    from charlie.runtime import Runtime
    from charlie.sweeps import sweep_stalled_runs
    from charlie.testing import RecordingPublisher
    from charlie.tools.registry import REGISTRY

    engine = get_engine(private_database)
    long_ago = datetime.now(UTC) - timedelta(minutes=5)
    stranded = stalled_run(engine, "probe", long_ago, phase=Phase.AWAIT_TOOLS.value)
    waiting = stalled_run(engine, "probe", long_ago, phase=Phase.AWAIT_TOOLS.value)
    with write(engine) as conn:
        for execution_id, state in ((stranded, CallState.SETTLED), (waiting, CallState.PENDING)):
            conn.execute(
                tool_calls.insert().values(
                    execution_id=execution_id,
                    call_id="c0",
                    turn=0,
                    idx=0,
                    name="ledger_write",
                    arguments={"key": "k"},
                    effect="write",
                    state=state.value,
                    outcome="ok" if state is CallState.SETTLED else None,
                    settled_at=long_ago if state is CallState.SETTLED else None,
                    queued_at=long_ago,
                    hold=None if state is CallState.SETTLED else "approval",
                )
            )
    monkeypatch.setenv("CHARLIE_DATABASE_URL", private_database)
    settings = replace(load_settings(), sweep_probe_seconds=3600.0)
    publisher = RecordingPublisher()
    rt = Runtime(
        settings=settings,
        engine=engine,
        worker="probe-test",
        publisher=publisher,  # type: ignore[arg-type]
        tools=REGISTRY,
    )
    rt.probed_at = time.monotonic()  # probed a moment ago: not due this round
    sweep_stalled_runs(rt)
    assert publisher.ticks == []
    rt.probed_at = None  # a process's first round probes
    sweep_stalled_runs(rt)
    assert publisher.ticks == [(stranded, Phase.AWAIT_TOOLS, 0)]
    sweep_stalled_runs(rt)  # probed now; and won for this stall period anyway
    assert publisher.ticks == [(stranded, Phase.AWAIT_TOOLS, 0)]


def test_during_a_rolling_upgrade_an_earlier_releases_lost_await_tick_is_found_each_round(
    private_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """I4 whatever release wrote the run: a worker of a release before migration 0016 settles a
    turn without storing a wake-up, and its await tick is lost; the run may hold a wake-up
    still ahead (an earlier wait's deadline). While such a worker beats (a live worker
    heartbeat without its settle-wakes one), every round probes the runs in await_tools, and a
    wake-up ahead hides none of them: found within a stall period and a round, not a probe
    period or the deadline."""
    from dataclasses import replace

    from charlie.config import load_settings
    from charlie.runtime import Runtime
    from charlie.store.engine import write_one
    from charlie.store.heartbeats import SETTLE_WAKES_PREFIX, WORKER_PREFIX, record_heartbeat
    from charlie.sweeps import sweep_stalled_runs
    from charlie.testing import RecordingPublisher
    from charlie.tools.registry import REGISTRY

    engine = get_engine(private_database)
    now = datetime.now(UTC)
    long_ago = now - timedelta(minutes=5)
    stranded = stalled_run(
        engine, "upgrade", long_ago, phase=Phase.AWAIT_TOOLS.value, wake_at=now + timedelta(hours=1)
    )
    with write(engine) as conn:
        conn.execute(
            tool_calls.insert().values(
                execution_id=stranded,
                call_id="c0",
                turn=0,
                idx=0,
                name="ledger_write",
                arguments={"key": "k"},
                effect="write",
                state=CallState.SETTLED.value,
                outcome="ok",
                settled_at=long_ago,
                queued_at=long_ago,
            )
        )
    monkeypatch.setenv("CHARLIE_DATABASE_URL", private_database)
    settings = replace(load_settings(), sweep_probe_seconds=3600.0)
    publisher = RecordingPublisher()
    rt = Runtime(
        settings=settings,
        engine=engine,
        worker="upgrade-test",
        publisher=publisher,  # type: ignore[arg-type]
        tools=REGISTRY,
    )
    rt.probed_at = time.monotonic()  # probed a moment ago
    with write_one(engine) as conn:  # a worker of this release: no upgrade under way
        record_heartbeat(conn, SETTLE_WAKES_PREFIX + "new", "new", now)
        record_heartbeat(conn, WORKER_PREFIX + "new", "new", now, "charlie")
    sweep_stalled_runs(rt)
    assert publisher.ticks == []
    with write_one(engine) as conn:  # ...and one of the release before it
        record_heartbeat(conn, WORKER_PREFIX + "old", "old", now, "charlie")
    sweep_stalled_runs(rt)
    assert publisher.ticks == [(stranded, Phase.AWAIT_TOOLS, 0)]
