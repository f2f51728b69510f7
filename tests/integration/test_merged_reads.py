"""What a merged transaction's next step knows without reading it again, checked
against the table on the real database, with no workers.

- ``runs.calls_as_left``: the turn's calls as a commit left them (its new calls, its queue and
  settle writes) equal the calls the next step would have loaded.
- ``runs.Fresh`` (PostgreSQL): a move that claims its next step reads the task as it is when
  the move runs, so a cancel committed while the model was called (after the tick's claim)
  is seen at the next step's boundary, as that step's own claim would have seen it (I18).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta

import pytest
from sqlalchemy import Engine, select, update

from charlie import scheduler
from charlie.domain import (
    CallState,
    Effect,
    ItemKind,
    NewCall,
    NewItem,
    Outcome,
    Phase,
    Settlement,
    TaskStatus,
    Transition,
    utcnow,
)
from charlie.store import runs
from charlie.store.engine import write
from charlie.store.schema import executions, tasks, tool_calls
from tests.conftest import BACKEND
from tests.support.databases import own_database

OWNER = "merged-reads@test"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """A database of its own: the shared cluster's beat would sweep these rows."""
    with own_database(tmp_path_factory, "merged_reads") as engine:
        yield engine


def claim_at(engine: Engine, phase: Phase) -> runs.Claim:
    """A submitted task's run, set at ``phase`` in turn 1, claimed by OWNER."""
    submitted = scheduler.submit(
        engine, prompt="merged", model="none", tools=None, task_id=None, timeout=None, metadata=None
    )
    with write(engine) as conn:
        conn.execute(
            update(executions)
            .where(executions.c.id == submitted.execution_id)
            .values(phase=phase.value, version=7, turn=1)
        )
        now = utcnow()
        claim = runs.claim_execution(
            conn, submitted.execution_id, phase, 7, OWNER, now, lease_seconds=30
        )
    assert claim is not None
    return claim


def new_call(call_id: str, index: int, settled: bool = False) -> NewCall:
    return NewCall(
        call_id=call_id,
        index=index,
        name="echo",
        arguments={"value": call_id, "n": [1, 2]},
        effect=Effect.READ,
        resumable=False,
        settled=(Outcome.ERROR, {"error": "unknown tool"}) if settled else None,
    )


def test_the_calls_a_move_leaves_are_the_calls_the_next_step_would_load(engine: Engine) -> None:
    """call_model inserts the turn's calls (one born settled) and dispatch queues them; then
    await_tools settles one: after each commit the derived calls equal a fresh load."""
    claim = claim_at(engine, Phase.CALL_MODEL)
    later = utcnow() + timedelta(seconds=60)
    with write(engine) as conn:
        modeled = Transition(
            to=Phase.DISPATCH_TOOLS,
            items=[NewItem(ItemKind.TOOL_CALL, {"name": "echo"}, call_id="c2")],
            calls=[new_call("c2", 1), new_call("c1", 0), new_call("bad", 2, settled=True)],
        )
        now = utcnow()
        assert runs.commit_transition(
            conn, claim, modeled, owner=OWNER, now=now, duration_ms=1.0, next_lease_until=later
        )
        derived = runs.calls_as_left(
            claim, None, modeled, now=now, owner=OWNER, dialect=conn.dialect.name
        )
        loaded = runs.load_calls(conn, claim.execution_id, claim.turn, lock=True)
        assert derived == loaded
        assert [c.call_id for c in loaded] == ["c1", "c2", "bad"]

        dispatch = runs.claimed_next(claim, modeled)
        queued = Transition(
            to=Phase.AWAIT_TOOLS, queue_calls=[("c1", later), ("c2", later), ("bad", later)]
        )
        now = utcnow()
        assert runs.commit_transition(
            conn, dispatch, queued, owner=OWNER, now=now, duration_ms=1.0, next_lease_until=later
        )
        derived = runs.calls_as_left(
            dispatch, loaded, queued, now=now, owner=OWNER, dialect=conn.dialect.name
        )
        loaded = runs.load_calls(conn, claim.execution_id, claim.turn, lock=True)
        assert derived == loaded
        assert all(c.queued_at == now and c.deadline_at == later for c in loaded)

        awaiting = runs.claimed_next(dispatch, queued)
        settled = Transition(
            to=Phase.ADVANCE_TURN,
            settle=[
                Settlement("c1", Outcome.OK, {"answer": [1, "two"], "ab": {"zz": 1, "a": 2}}, 3.5),
                # already settled at birth: the table's SETTLE leaves it, and so must the view
                Settlement("bad", Outcome.OK, "overwritten?"),
            ],
        )
        now = utcnow()
        assert runs.commit_transition(
            conn, awaiting, settled, owner=OWNER, now=now, duration_ms=1.0
        )
        derived = runs.calls_as_left(
            awaiting, loaded, settled, now=now, owner=OWNER, dialect=conn.dialect.name
        )
        loaded = runs.load_calls(conn, claim.execution_id, claim.turn, lock=True)
        assert derived == loaded
        # as text too (dict equality ignores key order; the model's prompt does not)
        assert derived is not None
        assert [json.dumps(c.result) for c in derived] == [json.dumps(c.result) for c in loaded]
        by_id = {c.call_id: c for c in loaded}
        assert by_id["c1"].state is CallState.SETTLED and by_id["c1"].settled_by == OWNER
        assert by_id["bad"].settled_by == "validation" and by_id["bad"].outcome is Outcome.ERROR
        assert by_id["c2"].state is CallState.PENDING


def test_a_new_turn_is_never_derived(engine: Engine) -> None:
    claim = claim_at(engine, Phase.ADVANCE_TURN)
    moved = Transition(to=Phase.CALL_MODEL, next_turn=True)
    assert runs.calls_as_left(claim, [], moved, now=utcnow(), owner=OWNER, dialect="sqlite") is None


@pytest.mark.skipif(
    not (BACKEND.database_url or "").startswith("postgresql"),
    reason="PostgreSQL only: SQLite serializes writers, so no stop commits inside a transaction "
    "and a move there claims no model call's step",
)
def test_a_move_that_claims_the_next_step_sees_a_cancel_committed_since_its_claim(
    engine: Engine,
) -> None:
    """I18: call_model's claim read the task running; a cancel commits while the model is
    called; the move that commits the model's output and claims dispatch reads the task as
    canceled, so dispatch's boundary stops the run instead of queueing its calls."""
    claim = claim_at(engine, Phase.CALL_MODEL)
    assert claim.task is not None and claim.task.status is not TaskStatus.CANCELED
    with write(engine) as other:
        other.execute(
            update(tasks)
            .where(tasks.c.id == claim.task_id)
            .values(status=TaskStatus.CANCELED.value)
        )
    with write(engine) as conn:
        modeled = Transition(to=Phase.DISPATCH_TOOLS, calls=[new_call("c1", 0)])
        now = utcnow()
        fresh = runs.commit_transition(
            conn,
            claim,
            modeled,
            owner=OWNER,
            now=now,
            duration_ms=1.0,
            next_lease_until=now + timedelta(seconds=30),
            fresh=True,
        )
        assert isinstance(fresh, runs.Fresh)
        dispatch = runs.claimed_next(claim, modeled, fresh, conn)
    assert dispatch.task is not None
    assert dispatch.task.status is TaskStatus.CANCELED
    # without what the move read, the step would see the claim's stale view
    stale = runs.claimed_next(claim, modeled)
    assert stale.task is not None and stale.task.status is not TaskStatus.CANCELED


def test_the_items_a_move_writes_are_known_as_the_table_returns_them(engine: Engine) -> None:
    """What a worker remembers of its own writes (store.transcripts) is what a read returns,
    key order included (a model's prompt must not change with a cache hit); a payload whose
    stored form cannot be predicted is not remembered."""
    claim = claim_at(engine, Phase.ADVANCE_TURN)
    payloads = [
        {"content": "x", "b": 1, "aa": {"zz": [1, {"bb": True, "a": None}], "é": "ü"}, "ab": [1]},
        {"role": "user", "content": "<script>", "message_id": "m", "sent_by": "ü"},
    ]
    with write(engine) as conn:
        moved = Transition(
            to=Phase.CALL_MODEL,
            items=[NewItem(ItemKind.TOOL_RESULT, p, call_id="c") for p in payloads],
        )
        assert runs.commit_transition(conn, claim, moved, owner=OWNER, now=utcnow(), duration_ms=1)
        written = runs.written_items(conn, claim, moved)
        loaded = runs.load_items(conn, claim.execution_id)
    assert written is not None
    assert [json.dumps(i.payload) for i in written] == [json.dumps(i.payload) for i in loaded]
    assert written == loaded
    # a prefix already known: only what follows it is read
    with write(engine) as conn:
        assert runs.load_items(conn, claim.execution_id, loaded[:1]) == loaded

    # Floats: jsonb keeps a number's decimal digits, so one written without an exponent comes
    # back as itself (predicted), and one with an exponent, or -0.0, may not.
    plain = {"m": 0.5, "t": 0.30000000000000004, "k": 12345678.9, "one": 1.0, "neg": -2.25}
    for payload, predicted in ((plain, True), ({"n": 1e16}, False), ({"z": -0.0}, False)):
        claim = claim_at(engine, Phase.ADVANCE_TURN)
        floats = Transition(
            to=Phase.CALL_MODEL, items=[NewItem(ItemKind.TOOL_RESULT, payload, call_id="c")]
        )
        with write(engine) as conn:
            assert runs.commit_transition(
                conn, claim, floats, owner=OWNER, now=utcnow(), duration_ms=1
            )
            written = runs.written_items(conn, claim, floats)
            loaded = runs.load_items(conn, claim.execution_id)
        if engine.dialect.name == "sqlite" or predicted:
            assert written is not None
            assert [json.dumps(i.payload) for i in written] == [
                json.dumps(i.payload) for i in loaded
            ]
        else:
            assert written is None
    if engine.dialect.name != "sqlite":
        assert loaded[0].payload["z"] == 0.0
        assert json.dumps(loaded[0].payload) == '{"z": 0.0}'  # not as written: not predicted


def test_the_finishing_order_rides_on_the_move(engine: Engine) -> None:
    """advance_turn's finishing order is written with its move (one statement on PostgreSQL,
    whatever the fan-out): each call gets its own number, and a move that matches nothing
    writes none."""
    claim = claim_at(engine, Phase.CALL_MODEL)
    later = utcnow() + timedelta(seconds=60)
    with write(engine) as conn:
        modeled = Transition(
            to=Phase.DISPATCH_TOOLS,
            calls=[new_call("c1", 0), new_call("c2", 1), new_call("c3", 2), new_call("c4", 3)],
        )
        assert runs.commit_transition(
            conn, claim, modeled, owner=OWNER, now=utcnow(), duration_ms=1, next_lease_until=later
        )
    advancing = replace(runs.claimed_next(claim, modeled), phase=Phase.ADVANCE_TURN)
    order = {"c2": 1, "c3": 2, "c1": 3}
    stale = Transition(to=Phase.CALL_MODEL, finish_order={"c4": 9}, next_turn=True)
    with write(engine) as conn:
        conn.execute(
            update(executions)
            .where(executions.c.id == claim.execution_id)
            .values(phase=Phase.ADVANCE_TURN.value)
        )
        # another version: the compare-and-set matches nothing, and nothing is written
        assert not runs.commit_transition(
            conn, replace(advancing, version=99), stale, owner=OWNER, now=utcnow(), duration_ms=1
        )
        moved = Transition(to=Phase.CALL_MODEL, finish_order=order, next_turn=True)
        assert runs.commit_transition(
            conn, advancing, moved, owner=OWNER, now=utcnow(), duration_ms=1
        )
    with engine.connect() as conn:
        rows = conn.execute(
            select(tool_calls.c.call_id, tool_calls.c.finish_order).where(
                tool_calls.c.execution_id == claim.execution_id
            )
        ).all()
    assert dict(rows) == {**order, "c4": None}


@pytest.mark.skipif(
    not (BACKEND.database_url or "").startswith("postgresql"),
    reason="PostgreSQL only: on SQLite a cancel cannot commit inside another writer's transaction",
)
@pytest.mark.parametrize("task_write", [True, False], ids=["with usage", "without a task write"])
def test_a_cancel_that_commits_while_the_move_waits_is_seen(
    engine: Engine, task_write: bool
) -> None:
    """I18: a cancel holds the task's row when the move starts, and commits while the move
    waits for it; what the move returns for the next claim is the canceled task, not the
    statement's snapshot (a review found the snapshot said running, and the model was
    called for a canceled task)."""
    claim = claim_at(engine, Phase.CALL_MODEL)
    with engine.connect() as canceler:
        trans = canceler.begin()
        canceler.execute(
            update(tasks)
            .where(tasks.c.id == claim.task_id)
            .values(status=TaskStatus.CANCELED.value)
        )

        def move() -> object:
            with write(engine) as conn:
                modeled = Transition(
                    to=Phase.DISPATCH_TOOLS,
                    calls=[new_call("c1", 0)],
                    usage={"output_tokens": 3} if task_write else None,
                )
                now = utcnow()
                fresh = runs.commit_transition(
                    conn,
                    claim,
                    modeled,
                    owner=OWNER,
                    now=now,
                    duration_ms=1.0,
                    next_lease_until=now + timedelta(seconds=30),
                    fresh=True,
                )
                assert isinstance(fresh, runs.Fresh)
                return runs.claimed_next(claim, modeled, fresh, conn)

        out: list[object] = []
        thread = threading.Thread(target=lambda: out.append(move()), daemon=True)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive(), "the move did not wait for the cancel's lock on the task"
        trans.commit()
    thread.join(10)
    assert out, "the move did not finish"
    dispatch = out[0]
    assert isinstance(dispatch, runs.Claim) and dispatch.task is not None
    assert dispatch.task.status is TaskStatus.CANCELED
