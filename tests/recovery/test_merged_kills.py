"""Recovery: a worker SIGKILLed inside a merged transaction, and just after it.

With inline steps on, a turn of one call commits in at most three transactions: A (call_model's
result with the dispatch that queues the call), the call's start (I9), and B (the call's settle,
whatever the tool's effect, with await_tools, advance_turn and the next call_model's claim). On
PostgreSQL each of A and B is one statement (a fused commit, charlie/store/fused.py), and a
read's start rides in A: a read turn commits twice. Each phase keeps its transition row. A
kill inside A or B rolls the whole transaction back (fused: nothing was sent yet); a kill just
after it leaves what it committed. Either way the run recovers exactly: no transition lost or
duplicated (versions consecutive, each transition starting where the last ended, I1, I2), no
model call repeated beyond the one counted repeat (I3), no tool handler run twice (I10), and
every call with its one result (I8).
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from dataclasses import dataclass

import pytest

import charlie
from charlie import api
from charlie.domain import TaskStatus
from tests.conftest import BACKEND, model_calls
from tests.integration.test_loop import assert_every_call_has_one_result
from tests.support.cluster import Cluster, fused_commits
from tests.support.tools import read_ledger

pytestmark = [
    pytest.mark.recovery,
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        os.environ.get("CHARLIE_TEST_INLINE_PHASES") == "0",
        reason="with every step published no transaction carries two phases",
    ),
]

#: the mode under test: "fused" (PostgreSQL: a merged transaction is one statement, a read's
#: start rides in A) or "stepwise" (SQLite, or CHARLIE_TEST_FUSE_COMMITS=0)
MODE = "fused" if fused_commits(BACKEND) else "stepwise"


@dataclass(frozen=True)
class Case:
    point: str
    #: the phase the fault point names (see tick._merge and tick._merged_end, executor/fused.py)
    phase: str | None
    #: the phase the merged transaction began with (tick.merged.end / after_commit)
    first: str | None
    #: the call's outcome after recovery
    outcome: str
    #: how many times the handler ran (its end recorded)
    ran: int
    #: model calls of turn 0 and of turn 1 (the scripted model's ledger)
    model_turns: tuple[int, int]
    #: the run's counted repeats (attempts of call_model beyond the first)
    repeats: int
    #: the turn's one call: a read (sleep_then) or a write (ledger_write)
    tool: str = "sleep_then"
    #: only in this mode (None: both)
    mode: str | None = None


CASES = [
    # The run's first transaction (load_context with call_model's claim), inside and after.
    Case("tick.merged.step", "call_model", "load_context", "ok", 1, (1, 1), 0),
    Case("tick.merged.end", "call_model", "load_context", "ok", 1, (1, 1), 0),
    Case("tick.merged.after_commit", "call_model", "load_context", "ok", 1, (1, 1), 1),
    # Inside A, after call_model's compare-and-set, before the dispatch's claim: all of A
    # rolls back; call_model's claim had committed, so the model is called again (the counted
    # repeat) and its result commits on its own this time; the call then starts normally.
    Case("tick.merged.step", "dispatch_tools", None, "ok", 1, (2, 1), 1),
    Case("tick.merged.step", "dispatch_tools", None, "ok", 1, (2, 1), 1, "ledger_write"),
    # Inside A before anything of it is written (the model's output computed, call_model's
    # own step about to be written), and inside A's dispatch step once its phase has run:
    # the same as above.
    Case("tick.before_commit", "call_model", None, "ok", 1, (2, 1), 1),
    Case("tick.in_transaction", "dispatch_tools", None, "ok", 1, (2, 1), 1),
    Case("tick.in_transaction", "dispatch_tools", None, "ok", 1, (2, 1), 1, "ledger_write"),
    # Inside A at its end (the dispatch written, the call queued), before COMMIT: the same.
    Case("tick.merged.end", "await_tools", "call_model", "ok", 1, (2, 1), 1),
    # Just after A's COMMIT. Stepwise: the call is queued, never started; the sweep starts it
    # (I11). Fused, a read: A started it (I9), for this worker, which died before the handler
    # ran: the sweep settles it interrupted and never runs it (I10). A write: as stepwise.
    Case("tick.merged.after_commit", "await_tools", "call_model", "ok", 1, (1, 1), 0,
         mode="stepwise"),
    Case("tick.merged.after_commit", "await_tools", "call_model", "interrupted", 0, (1, 1), 0,
         mode="fused"),
    Case("tick.merged.after_commit", "await_tools", "call_model", "ok", 1, (1, 1), 0,
         "ledger_write"),
    # After A's COMMIT, before the call's own start commits: the call is pending, the sweep
    # starts it (I11). (Fused, a read has no start of its own.)
    Case("tick.merged.before_start", None, None, "ok", 1, (1, 1), 0, mode="stepwise"),
    Case("tick.merged.before_start", None, None, "ok", 1, (1, 1), 0, "ledger_write"),
    # Inside B, after the settle and await_tools' compare-and-set, before advance_turn's
    # claim: B rolls back, the handler's result with it; the call is started and its lease
    # lapses, so the sweep settles it interrupted and never runs it again (I10).
    Case("tick.merged.step", "advance_turn", None, "interrupted", 1, (1, 1), 0),
    # Inside B once await_tools' phase has run (the result taken, the settle not yet written),
    # and once advance_turn's has (the results ordered into the transcript): the same.
    Case("tick.in_transaction", "await_tools", None, "interrupted", 1, (1, 1), 0),
    Case("tick.in_transaction", "advance_turn", None, "interrupted", 1, (1, 1), 0),
    # Inside B before the next call_model's claim is written: the same.
    Case("tick.merged.step", "call_model", "await_tools", "interrupted", 1, (1, 1), 0),
    # Inside B at its end (the next call_model claimed), before COMMIT: the same.
    Case("tick.merged.end", "call_model", "await_tools", "interrupted", 1, (1, 1), 0),
    # Just after B's COMMIT: the result is in; call_model was claimed by the dead worker,
    # whose lease lapses; the sweep re-publishes it and the model is called once for turn 1
    # (the claim that died counts as an attempt, so as a repeat, though no call was lost).
    Case("tick.merged.after_commit", "call_model", "await_tools", "ok", 1, (1, 1), 1),
    # Fused, a write's result rides in B too (its settle and the steps after it are one
    # statement): a kill before that statement is a kill before its settle; after it, kept.
    Case("tick.merged.end", "call_model", "await_tools", "interrupted", 1, (1, 1), 0,
         "ledger_write", "fused"),
    Case("tick.merged.after_commit", "call_model", "await_tools", "ok", 1, (1, 1), 1,
         "ledger_write", "fused"),
]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def warm(cluster_session: Cluster, tmp_path_factory: pytest.TempPathFactory) -> None:
    """One task through the cluster first: on a cold one the first tick may wait for a worker
    past the stall period and come back re-published (durable, so not merged), and the run's
    first merged transaction, whose kill points the first cases match, would not happen."""
    path = tmp_path_factory.mktemp("warm") / "script.json"
    path.write_text('[{"say": "warm"}]')
    task_id = charlie.submit("warm", model=f"scripted:{path}")
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED


def _ledger(task_id: str, event: str) -> list[dict[str, object]]:
    return [e for e in read_ledger() if e.get("task") == task_id and e.get("event") == event]


def _case_id(case: Case) -> str:
    return f"{case.point}-{case.phase}-{case.tool}" + (f"-{case.mode}" if case.mode else "")


def _runs(case: Case) -> list[object]:
    if case.mode not in (None, MODE):
        return [pytest.mark.skip(reason=f"a {case.mode} commit's case; this cluster's are {MODE}")]
    return []


@pytest.mark.parametrize("case", [pytest.param(c, id=_case_id(c), marks=_runs(c)) for c in CASES])
def test_a_kill_in_or_after_a_merged_transaction_recovers_exactly(
    cluster: Cluster, script, case: Case
) -> None:
    task_id = f"m17-{uuid.uuid4().hex[:12]}"
    match: dict[str, str] = {"task_id": task_id}
    if case.phase is not None:
        match["phase"] = case.phase
    if case.first is not None:
        match["first"] = case.first
    cluster.set_faults({case.point: {"action": "kill", "times": 1, "match": match}})
    if case.tool == "sleep_then":
        arguments: dict[str, object] = {"seconds": 0, "value": "v"}
        events = ("sleep_then.start", "sleep_then.end")
    else:
        arguments, events = {"key": task_id}, ("write",)
    model, ledger = script(
        [
            {"tool_calls": [{"id": "a", "name": case.tool, "arguments": arguments}]},
            {"say": "done", "tool_calls": []},
        ]
    )
    charlie.submit("kill in a merged transaction", model=model, task_id=task_id)
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert cluster.fault_count(case.point) == 1

    (call,) = api.calls(task_id)
    assert call.outcome == case.outcome, call
    for event in events:
        assert len(_ledger(task_id, event)) == case.ran  # never run twice (I10)
    turns = [c["turn"] for c in model_calls(ledger)]
    assert (turns.count(0), turns.count(1)) == case.model_turns, turns
    assert info.model_repeats == case.repeats
    assert_every_call_has_one_result(task_id)

    # No transition lost or duplicated: one per version, each from where the last one went.
    history = api.history(task_id)
    versions = [h["version"] for h in history]
    assert versions == list(range(versions[0], versions[0] + len(versions))), history
    for before, after in itertools.pairwise(history):
        assert after["from_phase"] == before["to_phase"], history
    assert history[-1]["to_phase"] == "done"


STALL = 6.0


def test_a_carried_model_claim_whose_lease_lapsed_meanwhile_calls_no_model(
    cluster: Cluster, script
) -> None:
    """I5, I3: B commits the next call_model's claim; if what follows its COMMIT (publishes,
    reports) stalls past the lease, the sweep hands the run to another worker, and this one
    must not call the model under the lease it lost: one model call for that turn, not two."""
    task_id = f"m17l-{uuid.uuid4().hex[:12]}"
    match = {"task_id": task_id, "phase": "call_model", "first": "await_tools"}
    # the cluster's lease is 2 s: a 6 s stall outlives it, and the sweep (every 0.5 s) hands
    # the run on within about 3 s
    pause = {"action": "pause", "seconds": STALL, "times": 1, "match": match}
    cluster.set_faults({"tick.merged.after_commit": pause})
    model, ledger = script(
        [
            {
                "tool_calls": [
                    {"id": "a", "name": "sleep_then", "arguments": {"seconds": 0, "value": "v"}}
                ]
            },
            {"say": "done", "tool_calls": []},
        ]
    )
    charlie.submit("a stall after B", model=model, task_id=task_id)
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert cluster.fault_count("tick.merged.after_commit") == 1
    # The run went on elsewhere; the stalled worker wakes later: give it time to act.
    (b,) = [h for h in api.history(task_id) if h["to_phase"] == "call_model" and h["version"] > 1]
    time.sleep(max(0.0, b["at"].timestamp() + STALL + 3 - time.time()))
    turns = [c["turn"] for c in model_calls(ledger)]
    assert (turns.count(0), turns.count(1)) == (1, 1), turns
    assert_every_call_has_one_result(task_id)


@pytest.mark.parametrize("tool", ["ledger_write", "sleep_then"])
def test_a_kill_after_a_dispatch_committed_alone_leaves_a_write_free_to_start(
    cluster: Cluster, script, tool: str
) -> None:
    """I11, I9, I10: a dispatch that commits on its own (here: after call_model's second try,
    which commits alone once a kill inside A made it repeat) starts a read in its own commit,
    but a write's start commits on its own after it, as after a merged or fused dispatch. A
    SIGKILL just after the dispatch's commit leaves the write pending, and the sweep starts it
    (it runs once); the read, started by the dead worker, settles interrupted and never runs."""
    task_id = f"m17d-{uuid.uuid4().hex[:12]}"
    cluster.set_faults(
        {
            # inside A: rolled back; call_model repeats and commits alone, dispatch after it
            "tick.merged.step": {
                "action": "kill",
                "times": 1,
                "match": {"task_id": task_id, "phase": "dispatch_tools"},
            },
            # just after that dispatch's own commit, before anything else
            "tick.after_commit": {
                "action": "kill",
                "times": 1,
                "match": {"task_id": task_id, "phase": "dispatch_tools"},
            },
        }
    )
    if tool == "sleep_then":
        arguments: dict[str, object] = {"seconds": 0, "value": "v"}
        event = "sleep_then.start"
    else:
        arguments, event = {"key": task_id}, "write"
    model, _ = script(
        [
            {"tool_calls": [{"id": "a", "name": tool, "arguments": arguments}]},
            {"say": "done", "tool_calls": []},
        ]
    )
    charlie.submit("kill after a dispatch of its own", model=model, task_id=task_id)
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert cluster.fault_count("tick.merged.step") == 1
    assert cluster.fault_count("tick.after_commit") == 1
    (call,) = api.calls(task_id)
    if tool == "ledger_write":
        assert call.outcome == "ok", call  # pending, then started by the sweep (I11)
        assert len(_ledger(task_id, event)) == 1
    else:
        assert call.outcome == "interrupted", call  # started with the dispatch (I10)
        assert len(_ledger(task_id, event)) == 0
    assert_every_call_has_one_result(task_id)
    history = api.history(task_id)
    versions = [h["version"] for h in history]
    assert versions == list(range(versions[0], versions[0] + len(versions))), history


def _commit_lost_then_read_back(
    cluster: Cluster, script, point: str, commit: str, prefix: str
) -> None:
    """A turn of one read, the commit named by ``point`` for ``commit``'s phase losing its
    connection once after the server committed it: the run goes on as committed."""
    task_id = f"{prefix}-{uuid.uuid4().hex[:12]}"
    match = {"task_id": task_id, "phase": commit}
    cluster.set_faults({point: {"action": "raise", "times": 1, "match": match}})
    model, ledger = script(
        [
            {
                "tool_calls": [
                    {"id": "a", "name": "sleep_then", "arguments": {"seconds": 0, "value": "v"}}
                ]
            },
            {"say": "done", "tool_calls": []},
        ]
    )
    charlie.submit("a connection lost after its commit", model=model, task_id=task_id)
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert cluster.fault_count(point) == 1
    (call,) = api.calls(task_id)
    assert call.outcome == "ok", call
    assert call.late_reports == 0, call  # no false evidence of a second result
    assert len(_ledger(task_id, "sleep_then.start")) == 1
    turns = [c["turn"] for c in model_calls(ledger)]
    assert (turns.count(0), turns.count(1)) == (1, 1), turns
    assert info.model_repeats == 0  # no claim orphaned, none counted again
    assert_every_call_has_one_result(task_id)
    history = api.history(task_id)
    versions = [h["version"] for h in history]
    assert versions == list(range(versions[0], versions[0] + len(versions))), history
    for before, after in itertools.pairwise(history):
        assert after["from_phase"] == before["to_phase"], history


@pytest.mark.skipif(
    MODE != "stepwise" or not (BACKEND.database_url or "").startswith("postgresql"),
    reason="a tick's transaction (stepwise, on PostgreSQL) whose connection is lost after it "
    "committed: SQLite has no server connection to lose, and fused commits are read back above",
)
@pytest.mark.parametrize("commit", ["call_model", "await_tools"], ids=["A", "B"])
def test_a_tick_commit_whose_connection_is_lost_after_it_committed_is_read_back(
    cluster: Cluster, script, commit: str
) -> None:
    """I1, I3, I10, I12: the server commits a tick's merged transaction, then the connection
    drops before the worker hears of it (its backend terminated for real). The outcome is read
    back (the transition's own row), not assumed: the tick goes on as committed, so the read
    runs once and settles ok with no late report of its own result, and the next model call's
    claim, this worker's, is used rather than left to lapse (no repeat counted for it). Taken
    as nothing written (the old path), B recorded the read's own result as a late report; A
    recovered either way, and is kept as the other commit a turn makes."""
    _commit_lost_then_read_back(cluster, script, "tick.commit.lost", commit, "m25s")


@pytest.mark.skipif(MODE != "fused", reason="a fused commit's connection lost after its commit")
@pytest.mark.parametrize("commit", ["call_model", "await_tools"], ids=["A", "B"])
def test_a_fused_commit_whose_connection_is_lost_after_it_committed_is_read_back(
    cluster: Cluster, script, commit: str
) -> None:
    """I1, I3, I9, I10, I12: the server commits a fused statement, then the connection drops
    before the worker hears of it (its backend terminated for real). The outcome is read back,
    not assumed: A (with a read started in it) goes on to run the read here, which settles ok
    and runs once, not interrupted as a start that nobody ran; B (the read's settle and the
    next model call's claim) goes on to the model call under that claim, with no late report
    of the call's own result and no orphaned claim (no repeat counted for it)."""
    _commit_lost_then_read_back(cluster, script, "store.fused.after_commit", commit, "m17c")


@pytest.mark.skipif(MODE != "fused", reason="a fused commit's connection lost after its commit")
def test_a_fused_commit_read_back_carries_the_budget_and_the_delegation(
    cluster: Cluster, script, tmp_path
) -> None:
    """I1, I3, I31: B's fused commit (a read's settle and the next model call's claim) of a
    task with a tokens budget that has delegated a child loses its connection after the server
    committed it. The read-back returns what the commit returns: the task's five token counts
    (read back as three, the claim's budget check raised, the tick died holding the claim and
    the call was counted as repeated) and that the task has delegated (read back as not, the
    claim's check skipped the child's spend and the model was called over the budget).

    The budget, 1,000 tokens: the parent's first two calls spend about 80 and the child about
    600 (under it at the third call), the third about 650 more (about 730 of its own, under
    it; with the child's, over it), so the fourth call is never made."""
    task_id = f"m35b-{uuid.uuid4().hex[:12]}"
    match = {"task_id": task_id, "phase": "await_tools", "turn": 2}
    point = "store.fused.after_commit"
    cluster.set_faults({point: {"action": "raise", "times": 1, "match": match}})
    child_model, _ = script([{"say": "y" * 2400}])
    model, ledger = script(
        [
            {"tool_calls": [{"id": "d", "name": "delegate", "arguments": {
                "prompt": "spend", "model": child_model}}]},
            {"tool_calls": [{"id": "w", "name": "wait_for_task", "arguments": {
                "task_id": "{task_id}.0.d"}}]},
            {"say": "z" * 2400, "tool_calls": [{"id": "a", "name": "sleep_then", "arguments": {
                "seconds": 0, "value": "v"}}]},
            {"say": "over the budget"},
        ]
    )  # fmt: skip
    charlie.submit("a budget read back", model=model, task_id=task_id, budget={"tokens": 1000})
    info = charlie.wait(task_id, timeout=120)
    assert cluster.fault_count(point) == 1
    assert info.status is TaskStatus.FAILED, info
    assert info.error["reason"] == "budget exceeded", info.error
    assert "delegated tasks" in info.error["message"], info.error
    assert api.get_task(f"{task_id}.0.d").status is TaskStatus.SUCCEEDED
    turns = [c["turn"] for c in model_calls(ledger)]
    assert turns == [0, 1, 2], turns  # the fourth call was never made
    # The read-back claim was used, not orphaned: its first attempt is the one that failed.
    assert info.error["attempt"] == 1, info.error
    assert info.model_repeats == 0
    (call,) = [c for c in api.calls(task_id) if c.call_id == "a"]
    assert call.outcome == "ok" and call.late_reports == 0, call
    history = api.history(task_id)
    versions = [h["version"] for h in history]
    assert versions == list(range(versions[0], versions[0] + len(versions))), history
