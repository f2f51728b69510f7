#!/usr/bin/env python
"""Crash harness: run many agent tasks while SIGKILLing random workers, then check every promise.

    python scripts/chaos.py --tasks 200 --kill-every 2
    python scripts/chaos.py --tasks 30 --broker-url redis://127.0.0.1:6379/13 \
        --database-url postgresql://postgres@127.0.0.1/charlie_chaos

Starts N worker processes and one beat (default sweep settings), submits tasks whose scripted
models call a mix of tools (quick reads, slow reads, writes recorded in a ledger outside
Charlie's tables, writes with a read-back reconcile hook, delegations with waits), and kills a
random worker's whole process group every few seconds; a supervisor restarts it. Meanwhile a
"person" thread acts on the tasks the way people do: it sends messages to a share of them
(some twice with the same message id, some after the task finished), approves or denies the
calls that need approval (``approved_write``, or a ledger-recorded write named in submit's
``approve=[...]``), answers ``ask_human`` questions, reconciles interrupted ``held_write``
calls from the ledger, tries a second verdict on some calls, and forks a few finished tasks.
A message goes out once its task reached a drawn turn (or while it is queued); since one that
arrives with a final answer makes one more model turn (I22), every script ends with spare final
turns. It prints what it did in a ``people:`` line, then checks every task and exits non-zero
on any violation:

- terminal status reached, and succeeded;
- every tool call has exactly one result, and the transcript's results are in call order (I7, I8);
- no write executed twice according to the ledger (I10);
- every call caught mid-flight by a kill settled interrupted or reconciled, or, for a resumable
  wait, was observed again; never dropped (I10);
- exactly one child per delegation (I19);
- every accepted message is in its task's transcript exactly once, as user input at a turn
  boundary (after all the results of the turn it closes, before the next model call's items),
  at the first boundary committed after its send and in send order; a duplicate send returns
  the same id; a message refused with TaskFinished is nowhere and was refused only after the
  task's final answer was in (I22);
- a call needing approval is never marked started while held, a denied call's tool never ran
  (ledger) and its one result is ``denied``, an approved call's tool ran at most once and only
  after the approve's commit time (ledger timestamp after the action's ``at``); a held
  ``held_write`` did not run between its hold and a ``not_done`` verdict (I23);
- the first verdict on each hold of a call stands: every second attempt is refused with
  VerdictConflict naming a verdict given on the call, and the call's outcome is the first
  verdict's; a call held again (approved, then interrupted: held for a reconcile) takes a
  verdict of its own, a refused one is a violation (the task is canceled) (I24);
- an ``ask_human`` call's result is the person's reply (and the model was shown it);
- calls waiting for a person hold no lease, and while more of them wait than there are worker
  slots (the first tasks ask at once, and the person holds back every answer until then and
  until other tasks finished, or for --hold-back seconds), other runs still move; and the run
  completes (I25);
- a fork of a finished task (``turn=0``) runs no tool call of its source again: the ledger's
  entries under the fork's id are its own turns' calls, the source gets none after the fork,
  its model never plays turn 0, its copied items are marked (I26);
- every action the person took is one operator-action row with its actor; refused ones none
  (I27).
- a share of tasks (``--mcp-share``) also calls an MCP read and an MCP write over stdio (the
  test server of tests/support/mcp_server.py, one per worker process); no MCP write executed
  twice according to the server's own ledger (I10).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import random
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.cluster import (  # noqa: E402
    Backend,
    Cluster,
    McpServers,
    cluster_env,
    flush_redis,
    recreate_postgres_database,
)

#: the name the person thread acts under (I27)
PERSON = "chaos-person"
#: each accepted message may make one more model turn (it arrived with a final answer, I22):
#: at most this many messages go to one task, and its script has as many spare final turns.
MAX_MESSAGES = 3
#: clock slack for comparing commit times across processes of one machine (seconds)
SLACK = 0.05
#: the ledger event each ledger-recorded write tool writes (tests/support/tools.py)
WRITE_EVENTS = {
    "ledger_write": "write",
    "idempotent_write": "write",
    "approved_write": "approved_write",
    "held_write": "held_write",
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=200)
    p.add_argument("--kill-every", type=float, default=2.0, help="seconds between kills")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--database-url", default=None, help="default: SQLite in a temp home")
    p.add_argument("--broker-url", default=None, help="default: the embedded broker")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--timeout", type=float, default=900.0, help="give up after this many s")
    p.add_argument(
        "--hold-back",
        type=float,
        default=60.0,
        help="once the first questions all wait, the person answers nothing for at most this "
        "long (I25)",
    )
    p.add_argument(
        "--mcp-share", type=float, default=0.25, help="share of tasks calling MCP tools (0: none)"
    )
    return p.parse_args()


def add_mcp_turn(plan: Plan, share: float, seed: int) -> None:
    """For a share of tasks, one more turn just before the final answer: an MCP read and an
    MCP write over stdio. It takes over what the final answer's turn was to be shown
    (the turn before it may be a person's), and has its own random stream, so the rest of a
    seed's run is what it was without it."""
    rng = random.Random(f"{seed}-mcp-{plan.n}")
    if rng.random() >= share:
        return
    n = plan.n
    calls = [
        {"id": "mr", "name": "mcp__files__lookup", "arguments": {"key": f"m-{n}"}},
        {
            "id": "mw",
            "name": "mcp__files__delete_record",
            "arguments": {"key": f"m-{n}", "hold": rng.uniform(0, 1)},
        },
    ]
    final = len(plan.turns) - MAX_MESSAGES - 1
    turn: dict[str, Any] = {"say": "the MCP tools", "tool_calls": calls}
    if "expect" in plan.turns[final]:
        turn["expect"] = plan.turns[final].pop("expect")
    plan.turns.insert(final, turn)


def mcp_violations(home: Path) -> list[str]:
    """I10 for MCP writes: the test server's ledger, outside Charlie, ran each at most once."""
    ledger = McpServers(home, 0, 0, 0).ledger
    if not ledger.exists():
        return []
    rows = [json.loads(line) for line in ledger.read_text().splitlines() if line.strip()]
    runs = Counter(r["key"] for r in rows if r["event"] == "delete.start")
    return [f"MCP write {key} ran {count}x" for key, count in runs.items() if count > 1]


@dataclass(frozen=True)
class Message:
    """A message the person is to send: ``after`` seconds from the submit (``at_turn`` None)
    or from when the task is seen at turn ``at_turn``; again ``resend`` s later, same id."""

    message_id: str
    text: str
    at_turn: int | None
    after: float
    resend: float | None


@dataclass
class Plan:
    """What one task does and what the person is to do with it."""

    n: int
    task_id: str
    turns: list[dict[str, Any]] = field(default_factory=list)
    delegates: bool = False
    #: submit's approve=[...]
    approve: list[str] | None = None
    #: call id -> what the person does with it: "approval", "reply", "reconcile"
    person_calls: dict[str, str] = field(default_factory=dict)
    #: ask_human call id -> the reply the person gives
    answers: dict[str, str] = field(default_factory=dict)
    messages: list[Message] = field(default_factory=list)
    #: send one more message once the task is finished (expect TaskFinished)
    late_message: bool = False
    fork: bool = False
    #: a fork: (source task id, the fork's own call ids, submitted at)
    fork_of: tuple[str, set[str], float] | None = None

    def needs_approval(self, name: str) -> bool:
        return name == "approved_write" or name in (self.approve or [])


def _expect_turn(calls: list[dict[str, Any]], answers: dict[str, str]) -> dict[str, Any]:
    """What the turn after ``calls`` must be shown: their results, in call order; an answered
    question's with its reply (charlie/models/scripted.py)."""
    wanted = []
    for call in calls:
        if call["id"] in answers:
            wanted.append({"call_id": call["id"], "outcome": "ok", "contains": answers[call["id"]]})
        else:
            wanted.append({"call_id": call["id"]})
    return {"tool_results": wanted}


def task_script(rng: random.Random, home: Path, n: int, early_ask: bool) -> Plan:
    """A task's turns: a random mix of the tool kinds and of the people's parts."""
    plan = Plan(n=n, task_id=f"chaos-{n}")
    turns = plan.turns
    #: turn index -> its calls, for the next turn's expectation
    person_turns: list[int] = []
    if early_ask:
        # The first tasks ask at once; the person holds back its answers (I25).
        ask = {"id": "ask0", "name": "ask_human", "arguments": {"question": f"task {n}: start?"}}
        plan.person_calls["ask0"] = "reply"
        plan.answers["ask0"] = f"go-ahead-{n}"
        turns.append({"say": "asking first", "tool_calls": [ask]})
        person_turns.append(len(turns) - 1)
    approval = rng.random()
    if 0.15 <= approval < 0.25:
        plan.approve = ["ledger_write"]  # the first look's write waits for a verdict
    elif 0.25 <= approval < 0.33:
        plan.approve = ["held_write"]
    first = [
        {"id": "quick", "name": "sleep_then", "arguments": {"seconds": 0.05, "value": "q"}},
        {
            "id": "slow",
            "name": "sleep_then",
            "arguments": {"seconds": rng.uniform(0.5, 2), "value": "s"},
        },
        {
            "id": "write",
            "name": "ledger_write",
            "arguments": {"key": f"w-{n}", "hold": rng.uniform(0, 1)},
        },
    ]
    rng.shuffle(first)
    if plan.approve == ["ledger_write"]:
        plan.person_calls["write"] = "approval"
        person_turns.append(len(turns))
    turns.append({"say": "first look", "sleep": rng.uniform(0, 0.4), "tool_calls": first})
    turns.append(
        {
            "say": "careful write",
            "tool_calls": [
                {
                    "id": "iw",
                    "name": "idempotent_write",
                    "arguments": {"key": f"iw-{n}", "hold": rng.uniform(0, 0.8)},
                }
            ],
        }
    )
    if approval < 0.15:
        plan.person_calls["aw"] = "approval"
        person_turns.append(len(turns))
        calls = [
            {"id": "aw", "name": "approved_write", "arguments": {"key": f"aw-{n}"}},
            {"id": "ar", "name": "sleep_then", "arguments": {"seconds": 0.3, "value": "r"}},
        ]
        rng.shuffle(calls)
        turns.append({"say": "a write that needs a person", "tool_calls": calls})
    elif plan.approve == ["held_write"]:
        # Approved, then maybe interrupted by a kill: then held for a reconcile as well.
        plan.person_calls["haw"] = "approval"
        person_turns.append(len(turns))
        turns.append(
            {
                "say": "a held write that needs approval",
                "tool_calls": [
                    {
                        "id": "haw",
                        "name": "held_write",
                        "arguments": {"key": f"haw-{n}", "hold": rng.uniform(0.5, 2)},
                    }
                ],
            }
        )
    if rng.random() < 0.25:
        plan.person_calls["ask"] = "reply"
        plan.answers["ask"] = f"colour-{n}-{rng.randrange(1000)}"
        person_turns.append(len(turns))
        turns.append(
            {
                "say": "a question",
                "tool_calls": [
                    {"id": "ask", "name": "ask_human", "arguments": {"question": f"task {n}?"}},
                    {"id": "aq", "name": "sleep_then", "arguments": {"seconds": 0.2, "value": "a"}},
                ],
            }
        )
    if plan.approve is None and rng.random() < 0.25:
        # Interrupted by a kill, it waits for a reconcile verdict instead of being reported.
        plan.person_calls["hw"] = "reconcile"
        person_turns.append(len(turns))
        turns.append(
            {
                "say": "a write whose interruption a person decides",
                "tool_calls": [
                    {
                        "id": "hw",
                        "name": "held_write",
                        "arguments": {"key": f"hw-{n}", "hold": rng.uniform(1, 3)},
                    }
                ],
            }
        )
    plan.delegates = rng.random() < 0.3
    if plan.delegates:
        child = home / "scripts" / f"child-{n}.json"
        child.write_text(
            json.dumps(
                [
                    {
                        "tool_calls": [
                            {
                                "id": "cq",
                                "name": "sleep_then",
                                "arguments": {"seconds": 0.2, "value": "c"},
                            }
                        ]
                    },
                    {"say": "child done", "sleep": rng.uniform(0, 0.5)},
                ]
            )
        )
        turns.append(
            {
                "tool_calls": [
                    {
                        "id": "d",
                        "name": "delegate",
                        "arguments": {"prompt": "child", "model": f"scripted:{child}"},
                    }
                ]
            }
        )
        # The child's id names the delegating turn (charlie/tools/delegation.py).
        turns.append(
            {
                "tool_calls": [
                    {
                        "id": "wait",
                        "name": "wait_for_task",
                        "arguments": {"task_id": f"{{task_id}}.{len(turns) - 1}.d"},
                    }
                ]
            }
        )
    # A slow final answer: a message may come while it is written (I22).
    turns.append({"say": f"task {n} finished", "sleep": rng.uniform(0, 1.5)})
    for index in person_turns:
        turns[index + 1]["expect"] = _expect_turn(turns[index]["tool_calls"], plan.answers)
    # A message that arrives while the model writes its final answer makes one more turn (I22).
    turns.extend({"say": f"task {n} finished after a late message"} for _ in range(MAX_MESSAGES))
    if rng.random() < 0.45:
        last = len(turns) - MAX_MESSAGES - 1  # the final answer's turn
        for k in range(rng.randint(1, MAX_MESSAGES)):
            # Most while it runs, at any of its turns (the last: with its final answer, or
            # after it), some while it is still queued (its start).
            at_turn = None if rng.random() < 0.2 else rng.randint(0, last)
            plan.messages.append(
                Message(
                    message_id=f"m-{n}-{k}",
                    text=f"note {k} for task {n}: mind {k * n}",
                    at_turn=at_turn,
                    after=rng.uniform(0, 0.5 if at_turn is None else 2.0),
                    resend=rng.uniform(0, 3) if rng.random() < 0.35 else None,
                )
            )
    plan.late_message = rng.random() < 0.15
    plan.fork = n % 10 == 5
    return plan


def fork_script(home: Path, source: Plan) -> tuple[Path, set[str]]:
    """The fork's model: its turns are numbered on from the source's turn 0 (it never plays
    turn 0); turn 1 must be shown the source's turn-0 results and the fork's message."""
    n = source.n
    shown = source.turns[0]["tool_calls"]
    calls = [
        {"id": "fw", "name": "ledger_write", "arguments": {"key": f"fork-{n}", "hold": 0.3}},
        {"id": "fq", "name": "sleep_then", "arguments": {"seconds": 0.3, "value": "f"}},
    ]
    turns: list[dict[str, Any]] = [
        {"say": "turn 0 is the source's; never played here"},
        {
            "expect": {**_expect_turn(shown, {}), "contains": [f"fork of task {n}"]},
            "say": "the fork's own turn",
            "tool_calls": calls,
        },
        {"expect": _expect_turn(calls, {}), "say": f"fork of task {n} finished"},
    ]
    turns.extend({"say": "fork finished after a late message"} for _ in range(MAX_MESSAGES))
    path = home / "scripts" / f"fork-{n}.json"
    # (a ledger stays in its script's directory: home/scripts/model-ledger.jsonl)
    path.write_text(json.dumps({"turns": turns, "ledger": "model-ledger.jsonl"}))
    return path, {c["id"] for c in calls}


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return pids


class Killer(threading.Thread):
    def __init__(self, cluster: Cluster, every: float, rng: random.Random) -> None:
        super().__init__(daemon=True, name="killer")
        self.cluster, self.every, self.rng = cluster, every, rng
        self.stop = threading.Event()
        self.kills: list[tuple[float, set[int]]] = []
        #: what each kill caught: (kill time, kind, execution id, turn, call id)
        self.held: list[tuple[float, str, str, int, str]] = []

    def snapshot(self, pids: set[int], at: float) -> None:
        """What the killed worker held: run leases and call leases (the work to recover)."""
        from sqlalchemy import select

        from charlie.runtime import get_runtime
        from charlie.store.engine import read
        from charlie.store.schema import executions, tool_calls

        def mine(owner: str | None) -> bool:
            return bool(owner) and int(str(owner).rsplit(":", 1)[1]) in pids

        e, c = executions.c, tool_calls.c
        with read(get_runtime().engine) as conn:
            for row in conn.execute(select(e.id, e.lease_owner).where(e.lease_owner.is_not(None))):
                if mine(row.lease_owner):
                    self.held.append((at, "run", row.id, 0, ""))
            for row in conn.execute(
                select(c.execution_id, c.turn, c.call_id, c.lease_owner).where(
                    c.state == "started", c.lease_owner.is_not(None)
                )
            ):
                if mine(row.lease_owner):
                    self.held.append((at, "call", row.execution_id, row.turn, row.call_id))

    def run(self) -> None:
        while not self.stop.wait(self.every):
            alive = self.cluster.alive_workers()
            if not alive:
                continue
            victim = self.rng.choice(alive)
            pids = set(group_pids(victim.pid))
            at = time.time()
            self.cluster.kill(victim)
            self.kills.append((at, pids))
            self.snapshot(pids, at)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


@dataclass
class Sent:
    """One send the person made (I22)."""

    task_id: str
    message_id: str
    text: str
    t0: float
    t1: float
    #: "accepted" (the first send of its id that went through), "duplicate" (same id again,
    #: same id back), "refused" (TaskFinished), "error"
    result: str
    detail: str = ""


@dataclass
class Verdict:
    """One verdict the person gave on a held call (I23, I24)."""

    task_id: str
    call_id: str
    turn: int
    hold: str
    action: str
    seen: float
    t0: float
    t1: float
    record_id: int
    at: float
    verdict: str | None = None
    answer: str | None = None


@dataclass
class Second:
    """A second verdict the person tried on a decided call: it must be refused (I24)."""

    task_id: str
    call_id: str
    action: str
    first_id: int
    result: str
    named: int | None = None
    detail: str = ""


class Person(threading.Thread):
    """The people: send messages, approve or deny, answer questions, reconcile, fork."""

    def __init__(
        self,
        plans: dict[str, Plan],
        rng: random.Random,
        home: Path,
        slots: int,
        hold_back: float,
    ) -> None:
        super().__init__(daemon=True, name="person")
        self.plans, self.rng, self.home, self.slots = plans, rng, home, slots
        self.hold_back_max = hold_back
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.queue: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self.serial = itertools.count()
        self.status: dict[str, str] = {}
        #: (task, message id) of the messages queued already
        self.scheduled: set[tuple[str, str]] = set()
        self.seen: dict[tuple[str, int, str, str], float] = {}
        self.due: dict[tuple[str, int, str, str], float] = {}
        self.sends: list[Sent] = []
        self.verdicts: list[Verdict] = []
        self.seconds: list[Second] = []
        self.canceled: dict[str, str] = {}
        self.forked: dict[str, str] = {}  # source -> fork id
        self.late_sent: set[str] = set()
        self.problems: list[str] = []
        self.unlisted: dict[tuple[str, str], int] = {}
        self.stats: Counter[str] = Counter()
        # I25: the first tasks ask at once, and nothing is answered until they all wait
        self.early = {t for t, p in plans.items() if "ask0" in p.person_calls}
        self.holding_back = bool(self.early)
        self.started = time.time()
        self.full_at: float | None = None
        self.terminal_at_full: set[str] = set()
        self.first_held_at: float | None = None
        self.held_at_full = 0
        self.waiting_at_full: set[str] = set()
        self.finished_while_held = 0
        self.moved_while_held = 0
        self.peak_held = 0
        self.held_back_for = 0.0

    # -- scheduling ---------------------------------------------------------------------------

    def schedule(self, plan: Plan, turn: int | None, at: float) -> None:
        """Queue the plan's messages due from now: at the submit (``turn`` None), those for
        the submit; seen at ``turn``, those for it and the turns before."""
        with self.lock:
            for m in plan.messages:
                if (plan.task_id, m.message_id) in self.scheduled:
                    continue
                if (m.at_turn is None) != (turn is None) or (turn or 0) < (m.at_turn or 0):
                    continue
                self.scheduled.add((plan.task_id, m.message_id))
                args = (plan.task_id, m.message_id, m.text)
                heapq.heappush(self.queue, (at + m.after, next(self.serial), "send", args))
                if m.resend is not None:
                    heapq.heappush(
                        self.queue, (at + m.after + m.resend, next(self.serial), "send", args)
                    )

    def later(self, delay: float, kind: str, *args: Any) -> None:
        with self.lock:
            heapq.heappush(self.queue, (time.time() + delay, next(self.serial), kind, args))

    def idle(self) -> bool:
        """Nothing left to do: no send or second verdict queued, no question or approval
        waiting, every fork and late message made."""
        with self.lock:
            if self.queue or self.seen:
                return False
        for plan in list(self.plans.values()):
            status = self.status.get(plan.task_id)
            if not terminal(status):
                return False
            if plan.fork and status == "succeeded" and plan.task_id not in self.forked:
                return False
            if plan.late_message and terminal(status) and plan.task_id not in self.late_sent:
                return False
        return True

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.step()
            except Exception:
                self.problems.append(f"person thread raised: {traceback.format_exc()[-600:]}")
            self.stop.wait(0.25)

    def step(self) -> None:
        from charlie import api

        now = time.time()
        infos = all_tasks(api)
        for info in infos:
            plan = self.plans.get(info.id)
            if plan is not None and info.status.value != "queued":
                self.schedule(plan, info.turn, now)
            self.status[info.id] = info.status.value
        held = {(i.id, w.turn, w.call_id, w.kind): w for i in infos for w in i.waiting_for}
        self.check_holds(set(held))
        for key in held:
            if key not in self.seen:
                self.seen[key] = now
                self.due[key] = now + self.rng.uniform(0.2, 3.0)
        for key in [k for k in self.seen if k not in held]:
            # Gone without a verdict of ours: a task canceled here, or a question past its
            # deadline (none in this run: the default deadline is a day).
            if key[0] not in self.canceled:
                self.problems.append(f"{key[0]}/{key[2]}: held for {key[3]}, then not, unasked")
            del self.seen[key], self.due[key]
        if self.holding_back:
            self.hold_back(now, held)
        else:
            for key in sorted(held, key=lambda k: self.due[k]):
                if self.due[key] <= time.time() and not self.stop.is_set():
                    self.decide(key, held[key])
                    del self.seen[key], self.due[key]
        self.run_queue()
        self.forks()
        self.late_messages()

    def check_holds(self, listed_keys: set[tuple[str, int, str, str]]) -> None:
        """I25: a call waiting for a person holds no lease; I23: one waiting for an approve or
        a reply was never marked started."""
        from sqlalchemy import select

        from charlie.domain import execution_id_for
        from charlie.runtime import get_runtime
        from charlie.store.engine import read
        from charlie.store.schema import tool_calls

        c = tool_calls.c
        with read(get_runtime().engine) as conn:
            rows = conn.execute(
                select(c.execution_id, c.call_id, c.hold, c.lease_owner, c.started_at).where(
                    c.hold.is_not(None), c.state != "settled"
                )
            ).all()
        listed = {(execution_id_for(k[0]), k[2]) for k in listed_keys}
        for row in rows:
            key = (row.execution_id, row.call_id)
            # A held call whose task does not say it waits (get_task().waiting_for) would wait
            # for nobody; twice in a row, so a hold that began between the two reads is not it.
            self.unlisted[key] = self.unlisted.get(key, 0) + 1 if key not in listed else 0
            if self.unlisted[key] == 2:
                self.problems.append(
                    f"{row.execution_id}/{row.call_id} is held for {row.hold} but its task "
                    "does not list it in waiting_for"
                )
            if row.lease_owner is not None:
                self.problems.append(
                    f"I25: {row.execution_id}/{row.call_id} waits for {row.hold} holding a "
                    f"lease ({row.lease_owner})"
                )
            if row.hold in ("approval", "reply") and row.started_at is not None:
                self.problems.append(
                    f"I23: {row.execution_id}/{row.call_id} waits for {row.hold} but was marked "
                    f"started at {row.started_at}"
                )
        self.peak_held = max(self.peak_held, len(rows), len(listed_keys))

    def hold_back(self, now: float, held: dict[tuple[str, int, str, str], Any]) -> None:
        """I25: answer nothing until more calls wait for a person than there are worker slots
        (the first tasks ask at once), then until other tasks finished meanwhile,
        or ``hold_back_max`` seconds. Under kills a slow machine may finish none in that time:
        the violation is that no other run moved at all (waits would then hold the workers)."""
        if held and self.first_held_at is None:
            self.first_held_at = now
        if self.full_at is None and len(held) > self.slots:
            self.full_at = now
            self.held_at_full = len(held)
            self.waiting_at_full = {k[0] for k in held}
            self.terminal_at_full = {t for t, s in self.status.items() if terminal(s)}
        if self.full_at is None:
            if now - (self.first_held_at or now) > self.hold_back_max:
                print(
                    f"note: no more than {self.peak_held} calls waited for a person at once "
                    f"within {self.hold_back_max:.0f} s of the first; I25 not exercised",
                    flush=True,
                )
                self.holding_back = False
            return
        finished = {
            t
            for t, s in self.status.items()
            if terminal(s) and t in self.plans and t not in self.terminal_at_full
        }
        waiting = {k[0] for k in held}
        movable = [
            t
            for t in self.plans
            if not terminal(self.status.get(t)) and t not in waiting and t not in finished
        ]
        if len(finished) < 2 and movable and now - self.full_at < self.hold_back_max:
            return
        self.holding_back = False
        self.finished_while_held = len(finished)
        self.held_back_for = now - self.full_at
        self.moved_while_held = self.moves_since(self.full_at)
        if movable and not finished and not self.moved_while_held:
            self.problems.append(
                f"I25: {self.held_at_full} calls waited for a person (worker slots: "
                f"{self.slots}) for {self.held_back_for:.0f} s and no other run moved meanwhile"
            )

    def moves_since(self, at: float) -> int:
        """Transitions since ``at`` of the runs that were not waiting for a person then."""
        from datetime import UTC, datetime

        from sqlalchemy import func, select

        from charlie.domain import execution_id_for
        from charlie.runtime import get_runtime
        from charlie.store.engine import read
        from charlie.store.schema import transitions

        tr = transitions.c
        with read(get_runtime().engine) as conn:
            return int(
                conn.execute(
                    select(func.count()).where(
                        tr.at >= datetime.fromtimestamp(at, UTC),
                        tr.execution_id.not_in([execution_id_for(t) for t in self.waiting_at_full]),
                    )
                ).scalar_one()
            )

    # -- verdicts -----------------------------------------------------------------------------

    def decide(self, key: tuple[str, int, str, str], waiting: Any) -> None:
        from charlie import api

        task_id, turn, call_id, hold = key
        plan = self.plans.get(task_id)
        expected = self.expected_hold(plan, waiting.tool, hold)
        if not expected:
            self.problems.append(
                f"{task_id}/{call_id} ({waiting.tool}): unexpectedly held for {hold}"
            )
        verdict = answer = None
        t0 = time.time()
        try:
            if hold == "approval":
                if self.rng.random() < 0.6:
                    action = "approve"
                    record = api.approve(task_id, call_id, note="looks fine", operator=PERSON)
                else:
                    action = "deny"
                    record = api.deny(task_id, call_id, "not in this run", operator=PERSON)
            elif hold == "reply":
                action = "reply"
                answer = (plan.answers.get(call_id) if plan else None) or f"answer-{call_id}"
                record = api.reply(task_id, call_id, answer, operator=PERSON)
            else:
                action = "reconcile"
                ran = ledger_entries(task_id, call_id, "held_write")
                result = None
                if ran:
                    verdict = "done"
                    result = {"written": ran[0].get("key"), "found_by": PERSON}
                else:
                    verdict = "not_done" if self.rng.random() < 0.8 else "unknown"
                record = api.reconcile(
                    task_id,
                    call_id,
                    verdict,
                    result=result,
                    note=f"ledger read back: {len(ran)} run(s)",
                    operator=PERSON,
                )
        except api.VerdictConflict as exc:
            self.problems.append(
                f"{task_id}/{call_id}: waits for {hold}, but the verdict is refused as a second "
                f"one: {exc}; the call cannot settle (canceling the task)"
            )
            self.cancel(task_id, f"stuck: {hold} refused")
            return
        except Exception as exc:
            self.problems.append(f"{task_id}/{call_id}: {hold} verdict raised {exc!r}")
            return
        t1 = time.time()
        self.stats[action if verdict is None else f"reconcile {verdict}"] += 1
        self.verdicts.append(
            Verdict(
                task_id=task_id,
                call_id=call_id,
                turn=turn,
                hold=hold,
                action=action,
                seen=self.seen[key],
                t0=t0,
                t1=t1,
                record_id=record.id,
                at=record.at.timestamp(),
                verdict=verdict,
                answer=answer,
            )
        )
        if hold in ("approval", "reply") and self.rng.random() < 0.4:
            # A second person (or the same, twice) decides again a little later (I24).
            again = self.rng.choice(
                ["approve", "deny"] if hold == "approval" else ["reply", "deny"]
            )
            self.later(self.rng.uniform(0, 1.5), "second", task_id, call_id, again, record.id)

    def expected_hold(self, plan: Plan | None, tool: str, hold: str) -> bool:
        if plan is None:
            return False
        if hold == "approval":
            return plan.needs_approval(tool)
        if hold == "reply":
            return tool == "ask_human"
        return tool == "held_write"

    def second(self, task_id: str, call_id: str, action: str, first_id: int) -> None:
        from charlie import api

        try:
            if action == "approve":
                api.approve(task_id, call_id, operator=f"{PERSON}-2")
            elif action == "deny":
                api.deny(task_id, call_id, "second thoughts", operator=f"{PERSON}-2")
            else:
                api.reply(task_id, call_id, "a second answer", operator=f"{PERSON}-2")
        except api.VerdictConflict as exc:
            self.seconds.append(Second(task_id, call_id, action, first_id, "refused", exc.first.id))
            return
        except Exception as exc:
            self.seconds.append(
                Second(task_id, call_id, action, first_id, "error", None, repr(exc))
            )
            return
        self.seconds.append(Second(task_id, call_id, action, first_id, "accepted"))

    def cancel(self, task_id: str, note: str) -> None:
        from charlie import api

        try:
            api.cancel(task_id, note=note, operator=PERSON)
            self.canceled[task_id] = note
        except Exception as exc:
            self.problems.append(f"{task_id}: cancel raised {exc!r}")

    # -- messages and forks -------------------------------------------------------------------

    def run_queue(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                if not self.queue or self.queue[0][0] > time.time():
                    return
                _, _, kind, args = heapq.heappop(self.queue)
            if kind == "send":
                self.send(*args)
            else:
                self.second(*args)

    def send(self, task_id: str, message_id: str, text: str) -> None:
        from charlie import api

        before = [s for s in self.sends if s.task_id == task_id and s.message_id == message_id]
        t0 = time.time()
        try:
            got = api.send(task_id, text, message_id=message_id, operator=PERSON)
        except api.TaskFinished as exc:
            result, detail = "refused", str(exc)[:100]
        except Exception as exc:
            result, detail = "error", repr(exc)
            self.problems.append(f"{task_id}: send {message_id} raised {exc!r}")
        else:
            result, detail = "accepted", ""
            if got != message_id:
                self.problems.append(f"{task_id}: send {message_id} returned {got!r}")
            if any(s.result == "accepted" for s in before):
                result = "duplicate"
        if before and {s.result for s in before} == {"refused"} and result != "refused":
            self.problems.append(
                f"I22: {task_id}: {message_id} was refused (TaskFinished), then {result}"
            )
        self.sends.append(Sent(task_id, message_id, text, t0, time.time(), result, detail))
        self.stats[f"send {result}"] += 1

    def late_messages(self) -> None:
        for plan in list(self.plans.values()):
            if (
                plan.late_message
                and terminal(self.status.get(plan.task_id))
                and plan.task_id not in self.late_sent
            ):
                self.late_sent.add(plan.task_id)
                self.send(plan.task_id, f"late-{plan.n}", f"too late for task {plan.n}")
                last = self.sends[-1]
                if last.result != "refused":
                    self.problems.append(
                        f"I22: {plan.task_id} is {self.status[plan.task_id]} but a message to it "
                        f"was {last.result}"
                    )

    def forks(self) -> None:
        from charlie import api

        for plan in list(self.plans.values()):
            if (
                not plan.fork
                or plan.task_id in self.forked
                or self.status.get(plan.task_id) != "succeeded"
            ):
                continue
            path, own = fork_script(self.home, plan)
            fork_id = f"fork-{plan.n}"
            t0 = time.time()
            try:
                got = api.fork(
                    plan.task_id,
                    turn=0,
                    message=f"fork of task {plan.n}: try again",
                    model=f"scripted:{path}",
                    task_id=fork_id,
                    operator=PERSON,
                )
            except Exception as exc:
                self.problems.append(f"{plan.task_id}: fork raised {exc!r}")
                self.forked[plan.task_id] = ""
                continue
            if got != fork_id:
                self.problems.append(f"{plan.task_id}: fork returned {got!r}, not {fork_id!r}")
            self.forked[plan.task_id] = fork_id
            self.stats["fork"] += 1
            self.plans[fork_id] = Plan(
                n=plan.n,
                task_id=fork_id,
                approve=plan.approve,
                person_calls={"fw": "approval"} if plan.needs_approval("ledger_write") else {},
                fork_of=(plan.task_id, own, t0),
            )

    def summary(self) -> str:
        s = self.stats
        return (
            f"people: {s['send accepted']} messages sent ({s['send duplicate']} again with the "
            f"same id, {s['send refused']} refused as finished), {s['approve']} approvals, "
            f"{s['deny']} denials, {s['reply']} replies, "
            f"{sum(v for k, v in s.items() if k.startswith('reconcile'))} reconciles, "
            f"{len(self.seconds)} second verdicts tried "
            f"({sum(x.result == 'refused' for x in self.seconds)} refused), {s['fork']} forks; "
            f"I25: up to {self.peak_held} calls waited for a person at once "
            f"({self.slots} worker slots); "
            + (
                f"while {self.held_at_full} waited, answered none for "
                f"{self.held_back_for:.0f} s: other runs made {self.moved_while_held} "
                f"transitions, {self.finished_while_held} tasks finished"
                if self.full_at is not None
                else "the hold-back never had more waiting than worker slots"
            )
        )


def terminal(status: str | None) -> bool:
    return status in ("succeeded", "failed", "canceled", "timed_out")


def all_tasks(api: Any) -> list[Any]:
    page = api.list_tasks(limit=1000)
    tasks = list(page)
    while len(page) == 1000:
        page = api.list_tasks(limit=1000, before=page[-1].id)
        tasks.extend(page)
    return tasks


def ledger_entries(task_id: str, call_id: str, event: str | None = None) -> list[dict[str, Any]]:
    from tests.support.tools import read_ledger

    return [
        e
        for e in read_ledger()
        if e.get("task") == task_id
        and e.get("call") == call_id
        and (event is None or e.get("event") == event)
    ]


def main() -> int:
    args = parse_args()
    rng = random.Random(args.seed)
    home = Path(tempfile.mkdtemp(prefix="charlie-chaos-"))
    (home / "scripts").mkdir()
    backend = Backend("chaos", args.database_url, args.broker_url)
    mcp = McpServers(home, 0, 0, 0, only=("files",)) if args.mcp_share > 0 else None
    env = cluster_env(home, backend, mcp=mcp)
    # Default recovery settings: the figures below are what an operator gets. Questions wait
    # as long as the person takes (the default deadline is a day).
    for key in (
        "CHARLIE_LEASE_SECONDS",
        "CHARLIE_STALL_SECONDS",
        "CHARLIE_SWEEP_INTERVAL",
        "CHARLIE_MAX_ATTEMPTS",
        "CHARLIE_DISPATCH_BATCH",
        "CHARLIE_HUMAN_DEADLINE",
    ):
        env.pop(key)
    for key in [k for k in os.environ if k.startswith("CHARLIE_")]:
        del os.environ[key]
    os.environ.update(env)
    if args.database_url and args.database_url.startswith("postgresql"):
        recreate_postgres_database(args.database_url)
    if args.broker_url and args.broker_url.startswith("redis"):
        flush_redis(args.broker_url)

    import charlie
    from charlie import api
    from charlie.config import settings
    from charlie.store.engine import upgrade

    upgrade(settings().database_url)
    cluster = Cluster(home=home, backend=backend, settings_env=env)
    cluster.set_faults({})
    cluster.ensure(workers=args.workers, beat=True)
    cluster.supervise()
    # The first kill waits for the first workers: on a busy machine a worker takes longer to
    # boot than the kill interval, and one killed booting tests no recovery.
    ready_by = time.time() + 60
    while (
        time.time() < ready_by
        and sum(" ready." in log.read_text(errors="replace") for log in home.glob("worker-*.log"))
        < args.workers
    ):
        time.sleep(0.5)
    time.sleep(2)
    slots = args.workers * args.concurrency
    # More questions than worker slots wait at once at the start (I25), leaving other tasks.
    early = min(slots + 1, max(0, args.tasks - 2))
    plans: dict[str, Plan] = {}
    for n in range(args.tasks):
        plan = task_script(rng, home, n, early_ask=n < early)
        add_mcp_turn(plan, args.mcp_share, args.seed)
        (home / "scripts" / f"task-{n}.json").write_text(json.dumps(plan.turns))
        plans[plan.task_id] = plan
    print(
        f"chaos: {args.tasks} tasks, kill every {args.kill_every}s, {args.workers} workers "
        f"x {args.concurrency}, db {settings().database_url.split(':')[0]}, "
        f"broker {settings().broker_url.split(':')[0]}, home {home}",
        flush=True,
    )

    killer = Killer(cluster, args.kill_every, rng)
    person = Person(plans, random.Random(args.seed + 1), home, slots, args.hold_back)
    started = time.time()
    try:
        killer.start()
        person.start()
        for plan in list(plans.values()):
            at = time.time()
            charlie.submit(
                f"chaos task {plan.n}",
                model=f"scripted:{home / 'scripts' / f'task-{plan.n}.json'}",
                task_id=plan.task_id,
                approve=plan.approve,
            )
            person.schedule(plan, None, at)
        deadline = started + args.timeout
        done: set[str] = set()
        while time.time() < deadline:
            for task_id in [t for t in list(plans) if t not in done]:
                if api.get_task(task_id).terminal:
                    done.add(task_id)
            if len(done) == len(plans) and person.idle():
                break
            time.sleep(0.5)
        pending = set(plans) - done
        killer.stop.set()
        killer.join()
        person.stop.set()
        person.join()
        # Let children and late reports land before checking.
        time.sleep(3)
        code = check(args, killer, person, plans, started, pending)
        problems = mcp_violations(home)
        for problem in problems:
            print(f"  - {problem}")
        return 1 if problems else code
    finally:
        killer.stop.set()
        person.stop.set()
        cluster.stop()


def check(
    args: argparse.Namespace,
    killer: Killer,
    person: Person,
    plans: dict[str, Plan],
    started: float,
    unfinished: set[str],
) -> int:
    from sqlalchemy import select

    from charlie import api
    from charlie.runtime import get_runtime
    from charlie.store.engine import read
    from charlie.store.schema import tool_calls, transitions
    from tests.support.tools import read_ledger

    violations: list[str] = list(person.problems)
    stats: Counter[str] = Counter()
    ledger = read_ledger()
    executed = Counter(
        (e["task"], e["call"]) for e in ledger if e["event"] in set(WRITE_EVENTS.values())
    )
    killed_ids = {pid for _, pids in killer.kills for pid in pids}
    for task_id in unfinished:
        violations.append(f"{task_id}: not terminal after {args.timeout}s")
    for task_id, plan in plans.items():
        info = api.get_task(task_id)
        succeeded = info.status.value == "succeeded"
        if task_id not in unfinished and not succeeded and task_id not in person.canceled:
            violations.append(f"{task_id}: ended {info.status.value}: {str(info.error)[:300]}")
        stats["model_repeats"] += info.model_repeats
        items = api.transcript(task_id)
        calls = api.calls(task_id)
        by_turn: dict[int, list[str]] = defaultdict(list)
        # A fork's copied history has results without call records of its own (I26).
        own = [i for i in items if not i.payload.get("copied_from")]
        for item in own:
            if item.kind == "tool_result":
                by_turn[item.turn].append(item.call_id or "")
        results = Counter((i.turn, i.call_id) for i in own if i.kind == "tool_result")
        for call in calls:
            if results[(call.turn, call.call_id)] != 1 and succeeded:
                violations.append(
                    f"{task_id}/{call.call_id}: {results[(call.turn, call.call_id)]} results"
                )
            stats["calls"] += 1
            stats["late_reports"] += call.late_reports
            if call.outcome == "interrupted":
                stats["interrupted"] += 1
            if isinstance(call.result, dict) and call.result.get("reconciled"):
                stats["reconciled"] += 1
            if call.name in WRITE_EVENTS and executed[(task_id, call.call_id)] > 1:
                violations.append(
                    f"{task_id}/{call.call_id}: write ran {executed[(task_id, call.call_id)]}x"
                )
                stats["duplicates"] += 1
            if call.state != "settled" and task_id not in person.canceled:
                violations.append(f"{task_id}/{call.call_id}: left {call.state}")
                stats["orphans"] += 1
            pid = int(call.started_by.rsplit(":", 1)[1]) if call.started_by else None
            settler = call.settled_by or ""
            caught = pid in killed_ids and not settler.endswith(f":{pid}")
            if (
                caught
                and call.name != "wait_for_task"
                and call.outcome == "ok"
                and not (isinstance(call.result, dict) and call.result.get("reconciled"))
                and not settler.startswith("operator:")  # a person's reconcile said "done"
            ):
                violations.append(
                    f"{task_id}/{call.call_id}: caught by a kill but reported plain ok"
                )
            if caught:
                stats["caught_mid_flight"] += 1
        for turn, ids in by_turn.items():
            order = [
                c.call_id
                for c in sorted((c for c in calls if c.turn == turn), key=lambda c: c.index)
            ]
            if ids != order:
                violations.append(f"{task_id} turn {turn}: results {ids} != call order {order}")
        if plan.delegates:
            delegations = [c for c in calls if c.name == "delegate"]
            kids = charlie_children(task_id)
            # I19: one child per delegation. Recovery finishes a delegation its worker died in,
            # so only an `interrupted` call (its workers died max_attempts times, or recovery
            # itself failed) may end without its child; an `error` one never made it.
            outcomes = {c.outcome for c in delegations}
            if (
                len(delegations) != 1
                or len(kids) > 1
                or ("ok" in outcomes and not kids)
                or ("error" in outcomes and kids)
            ):
                shown = [(c.call_id, c.outcome, str(c.result)[:160]) for c in delegations]
                violations.append(
                    f"{task_id}: {len(kids)} children for {len(delegations)} delegations {shown}"
                )
            stats["children"] += len(kids)
        violations += check_messages(plan, person, items, calls, succeeded)
        violations += check_verdicts(plan, person, items, calls, ledger, succeeded)
        violations += check_actions(plan, person)
        if plan.fork_of is not None:
            violations += check_fork(plan, items, calls, ledger, succeeded)
            stats["forks"] += 1
    for second in person.seconds:
        mine = {v.record_id for v in person.verdicts if (v.task_id, v.call_id) == (
            second.task_id, second.call_id)}  # fmt: skip
        if second.result != "refused":
            violations.append(
                f"I24: {second.task_id}/{second.call_id}: a second {second.action} was "
                f"{second.result} {second.detail}".rstrip()
            )
        elif second.named not in mine:
            violations.append(
                f"I24: {second.task_id}/{second.call_id}: the refused second {second.action} "
                f"names action {second.named}, not a verdict given on the call ({sorted(mine)})"
            )

    # Time from each kill to what it interrupted moving again: a held run's next transition, a
    # held call's settlement (or, for a parked wait, its next claim).
    rt = get_runtime()
    recoveries: list[float] = []
    with read(rt.engine) as conn:
        moves = conn.execute(select(transitions.c.execution_id, transitions.c.at)).all()
        settled = {
            (r.execution_id, r.turn, r.call_id): r.settled_at
            for r in conn.execute(
                select(
                    tool_calls.c.execution_id,
                    tool_calls.c.turn,
                    tool_calls.c.call_id,
                    tool_calls.c.settled_at,
                )
            )
        }
    by_run: dict[str, list[float]] = defaultdict(list)
    for m in moves:
        by_run[m.execution_id].append(m.at.timestamp())
    for at, kind, execution_id, turn, call_id in killer.held:
        if kind == "run":
            after = [t for t in by_run[execution_id] if t > at]
            if after:
                recoveries.append(min(after) - at)
        else:
            done = settled.get((execution_id, turn, call_id))
            if done is not None and done.timestamp() > at:
                recoveries.append(done.timestamp() - at)
    elapsed = time.time() - started
    print()
    print(
        "| tasks | kills | calls | caught mid-flight | interrupted | reconciled | late reports | "
        "model repeats | duplicates | orphans | kill → progress p50 / p95 | wall time |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {len(plans)} | {len(killer.kills)} | {stats['calls']} | "
        f"{stats['caught_mid_flight']} | "
        f"{stats['interrupted']} | {stats['reconciled']} | {stats['late_reports']} | "
        f"{stats['model_repeats']} | {stats['duplicates']} | {stats['orphans']} | "
        f"{pct(recoveries, 0.5):.1f} s / {pct(recoveries, 0.95):.1f} s (n={len(recoveries)}) | "
        f"{elapsed:.0f} s |"
    )
    print(person.summary())
    if violations:
        print(f"\n{len(violations)} violation(s):")
        for v in violations[:50]:
            print(f"  - {v}")
        return 1
    print("\nno violations")
    return 0


MODEL_KINDS = ("message", "reasoning", "tool_call", "final")


def created_at(task_id: str) -> dict[int, float]:
    """When each transcript item was committed (its transition's time), by seq."""
    from sqlalchemy import select

    from charlie.domain import execution_id_for
    from charlie.runtime import get_runtime
    from charlie.store.engine import read
    from charlie.store.schema import transcript_items

    i = transcript_items.c
    with read(get_runtime().engine) as conn:
        rows = conn.execute(
            select(i.seq, i.created_at).where(i.execution_id == execution_id_for(task_id))
        ).all()
    return {r.seq: r.created_at.timestamp() for r in rows}


def check_messages(
    plan: Plan,
    person: Person,
    items: list[Any],
    calls: list[Any],
    succeeded: bool,
    when: dict[int, float] | None = None,
) -> list[str]:
    """I22: every accepted message exactly once, at the first boundary after its send, in send
    order; a refused one nowhere, refused only once the final answer was in."""
    task_id = plan.task_id
    sends = [s for s in person.sends if s.task_id == task_id]
    if not sends and not any(i.payload.get("message_id") for i in items):
        return []
    out: list[str] = []
    when = created_at(task_id) if when is None else when
    accepted = [s for s in sends if s.result == "accepted"]
    first = {s.message_id: s for s in accepted}
    for s in sends:
        if s.result == "duplicate" and s.message_id not in first:
            out.append(f"I22: {task_id}: {s.message_id} a duplicate of nothing")
    refused = {s.message_id for s in sends if s.result == "refused"} - set(first)
    unsure = {s.message_id for s in sends if s.result == "error"} - set(first)
    mine = [i for i in items if i.payload.get("message_id") and not i.payload.get("copied_from")]
    seen = Counter(i.payload["message_id"] for i in mine)
    for message_id in first:
        if seen[message_id] != 1 and (succeeded or seen[message_id] > 1):
            out.append(f"I22: {task_id}: {message_id} is in the transcript {seen[message_id]}x")
    for message_id in seen:
        if message_id in refused:
            out.append(f"I22: {task_id}: {message_id} was refused (TaskFinished) yet entered")
        elif message_id not in first and message_id not in unsure:
            out.append(f"I22: {task_id}: {message_id} entered but was never sent")
        elif seen[message_id] > 1 and message_id in unsure:
            out.append(f"I22: {task_id}: {message_id} is in the transcript {seen[message_id]}x")
    order = [i.payload["message_id"] for i in mine if i.payload["message_id"] in first]
    if order != [s.message_id for s in accepted if s.message_id in order]:
        out.append(f"I22: {task_id}: messages entered as {order}, sent as {list(first)}")
    if refused and succeeded and task_id not in person.canceled:
        finals = [when[i.seq] for i in items if i.kind == "final"]
        for s in sends:
            if s.result == "refused" and not any(f <= s.t1 + SLACK for f in finals):
                out.append(
                    f"I22: {task_id}: {s.message_id} refused as finished at {s.t0:.2f} before "
                    "any final answer was in"
                )
    ncalls = Counter(c.turn for c in calls)
    position = {i.seq: n for n, i in enumerate(items)}
    # Where the mailbox is read: the run's start, each turn's results, a final answer's report.
    boundaries: list[int] = []
    for n, item in enumerate(items):
        before = items[n - 1] if n else None
        results = item.kind == "tool_result" and (
            before is None or before.kind != "tool_result" or before.turn != item.turn
        )
        report = item.kind == "input" and before is not None and before.kind == "final"
        if n == 0 or results or report:
            boundaries.append(item.seq)
    for item in mine:
        message_id = item.payload["message_id"]
        s = first.get(message_id)
        if s is not None and item.payload.get("content") != s.text:
            out.append(f"I22: {task_id}: {message_id} entered as {item.payload.get('content')!r}")
        k = position[item.seq]
        a = k
        while a > 0 and items[a - 1].kind == "input":
            a -= 1
        b = k
        while b + 1 < len(items) and items[b + 1].kind == "input":
            b += 1
        prev = items[a - 1] if a > 0 else None
        after = items[b + 1] if b + 1 < len(items) else None
        where = f"I22: {task_id}: {message_id} (seq {item.seq}, turn {item.turn})"
        if prev is None:
            delivered_at = items[0].seq
            if item.turn != 0:
                out.append(f"{where}: with the prompt but not at turn 0")
        elif prev.kind == "tool_result":
            delivered_at = min(
                i.seq for i in items if i.kind == "tool_result" and i.turn == prev.turn
            )
            shown = sum(1 for i in items[:k] if i.kind == "tool_result" and i.turn == prev.turn)
            # Taken with the results (advance_turn), a message carries the turn it follows;
            # committed after them and taken at call_model's boundary (take_mail), it carries
            # the turn about to call the model. Both are the same boundary.
            if item.turn not in (prev.turn, prev.turn + 1) or shown != ncalls[prev.turn]:
                out.append(
                    f"{where}: after {shown} of turn {prev.turn}'s {ncalls[prev.turn]} results"
                )
        elif prev.kind == "final" or (
            # a final answer that mail reopened is kept as the turn's last assistant message
            # (charlie/executor/phases/mailbox.reopen_final): a boundary when its turn called
            # no tool
            prev.kind == "message" and ncalls.get(prev.turn, 0) == 0
        ):
            delivered_at = items[a].seq
            if item.turn != prev.turn:
                out.append(f"{where}: after turn {prev.turn}'s final answer, not at its turn")
        else:
            delivered_at = item.seq
            out.append(f"{where}: not at a turn boundary (after a {prev.kind} item)")
        if after is None:
            if succeeded:
                out.append(f"{where}: no model call came after it")
        elif after.kind not in MODEL_KINDS or after.turn != (
            prev.turn + 1 if prev is not None else item.turn
        ):
            out.append(f"{where}: followed by a {after.kind} item of turn {after.turn}")
        if s is None:
            continue
        if when[item.seq] < s.t0 - SLACK:
            out.append(f"{where}: entered at {when[item.seq]:.3f}, before its send at {s.t0:.3f}")
        for seq in boundaries:
            if seq < delivered_at and when[seq] > s.t1 + SLACK:
                out.append(
                    f"{where}: sent by {s.t1:.3f}, but the boundary at seq {seq} committed at "
                    f"{when[seq]:.3f} without it (it entered at {when[item.seq]:.3f})"
                )
                break
    return out


def check_verdicts(
    plan: Plan,
    person: Person,
    items: list[Any],
    calls: list[Any],
    ledger: list[dict[str, Any]],
    succeeded: bool,
) -> list[str]:
    """I23, I24 and questions: what the ledger says each verdict let happen."""
    task_id = plan.task_id
    out: list[str] = []
    mine = [v for v in person.verdicts if v.task_id == task_id]
    for call in calls:
        name = f"{task_id}/{call.call_id} ({call.name})"
        verdicts = [v for v in mine if v.call_id == call.call_id and v.turn == call.turn]
        event = WRITE_EVENTS.get(call.name)
        ran = [
            e
            for e in ledger
            if event and (e.get("task"), e.get("call"), e.get("event")) == (
                task_id, call.call_id, event)
        ]  # fmt: skip
        if plan.needs_approval(call.name):
            approvals = [v for v in verdicts if v.hold == "approval"]
            if len(approvals) != 1:
                if succeeded or ran:
                    out.append(
                        f"I23: {name}: needed approval, {len(approvals)} verdicts, ran {len(ran)}x"
                    )
                continue
            v = approvals[0]
            if v.action == "deny":
                if ran:
                    out.append(f"I23: {name}: denied, yet its tool ran {len(ran)}x")
                if call.outcome != "denied" or call.started_at is not None:
                    out.append(
                        f"I23: {name}: denied, but settled {call.outcome}, started at "
                        f"{call.started_at}"
                    )
            else:
                early = [e for e in ran if float(e["t"]) <= v.at]
                if early:
                    out.append(
                        f"I23: {name}: ran at {early[0]['t']:.3f}, not after the approve "
                        f"committed at {v.at:.3f}"
                    )
                if call.started_at is not None and call.started_at.timestamp() < v.at:
                    out.append(
                        f"I23: {name}: marked started at {call.started_at.timestamp():.3f}, "
                        f"before the approve at {v.at:.3f}"
                    )
                if call.outcome == "denied":
                    out.append(f"I24: {name}: approved first, yet settled denied")
        elif any(v.hold == "approval" for v in verdicts):
            out.append(f"I23: {name}: approved or denied, but it needed no approval")
        for v in verdicts:
            if v.hold == "reconcile" and v.verdict == "not_done":
                # Held, it did not run again until the not_done verdict (I23).
                inside = [e for e in ran if v.seen < float(e["t"]) <= v.at]
                if inside:
                    out.append(
                        f"I23: {name}: held for a verdict from {v.seen:.3f}, yet ran at "
                        f"{inside[0]['t']:.3f} before the not_done at {v.at:.3f}"
                    )
        last = verdicts[-1] if verdicts else None
        if last is not None and last.hold == "reconcile" and last.verdict != "not_done":
            wanted = "ok" if last.verdict == "done" else "interrupted"
            if call.outcome != wanted:
                out.append(f"I24: {name}: reconciled {last.verdict}, yet settled {call.outcome}")
        if call.name == "ask_human":
            replies = [v for v in verdicts if v.hold == "reply"]
            answer = plan.answers.get(call.call_id)
            if not succeeded and not replies:
                continue
            shown = [i for i in items if i.kind == "tool_result" and i.call_id == call.call_id]
            if len(replies) != 1 or replies[0].answer != answer:
                out.append(f"{name}: {len(replies)} replies, wanted one of {answer!r}")
            elif (call.outcome, call.result) != ("ok", answer):
                out.append(
                    f"{name}: the reply was {answer!r}, the result {call.outcome} {call.result!r}"
                )
            elif not shown or answer not in str(shown[0].payload.get("content")):
                out.append(f"{name}: the reply {answer!r} is not the result the model was shown")
    return out


def check_actions(plan: Plan, person: Person) -> list[str]:
    """I27: each action the person took is one durable row under its name; a refused one none."""
    from charlie import api

    task_id = plan.task_id
    wanted: Counter[tuple[str, str]] = Counter()
    for s in person.sends:
        if s.task_id == task_id and s.result == "accepted":
            wanted[("send", s.message_id)] += 1
    for v in person.verdicts:
        if v.task_id == task_id:
            wanted[(v.action, v.call_id)] += 1
    if person.forked.get(task_id):
        wanted[("fork", person.forked[task_id])] += 1
    if task_id in person.canceled:
        wanted[("cancel", "")] += 1
    got: Counter[tuple[str, str]] = Counter()
    for record in api.actions(task_id):
        if not record.actor.startswith(PERSON):
            continue
        detail = record.detail or {}
        key = record.call_id or detail.get("message_id") or detail.get("fork") or ""
        got[(record.action.value, str(key))] += 1
    if got != wanted:
        return [f"I27: {task_id}: actions recorded {dict(got - wanted)} beyond, "
                f"{dict(wanted - got)} missing"]  # fmt: skip
    return []


def check_fork(
    plan: Plan, items: list[Any], calls: list[Any], ledger: list[dict[str, Any]], succeeded: bool
) -> list[str]:
    """I26: the fork runs none of its source's calls again; its history is a marked copy."""
    from charlie import api

    assert plan.fork_of is not None
    source, own, forked_at = plan.fork_of
    fork_id = plan.task_id
    out: list[str] = []
    if any(c.turn < 1 for c in calls):
        out.append(f"I26: {fork_id}: has call records of turn 0 (the source's)")
    if succeeded and {c.call_id for c in calls} != own:
        out.append(f"I26: {fork_id}: calls {sorted(c.call_id for c in calls)}, not {sorted(own)}")
    theirs = [e for e in ledger if e.get("task") == fork_id and e.get("call") not in own]
    if theirs:
        out.append(f"I26: {fork_id}: ran calls that are not its own: {theirs[:3]}")
    again = [e for e in ledger if e.get("task") == source and float(e["t"]) >= forked_at]
    if again:
        out.append(f"I26: {fork_id}: its source {source} ran calls after the fork: {again[:3]}")
    model_ledger = Path(os.environ["CHARLIE_HOME"]) / "scripts" / "model-ledger.jsonl"
    played = [
        json.loads(line)["turn"]
        for line in (model_ledger.read_text().splitlines() if model_ledger.exists() else [])
        if line.strip() and json.loads(line)["task_id"] == fork_id
    ]
    if 0 in played or (succeeded and not played):
        out.append(f"I26: {fork_id}: its model played turns {played}")
    copied = [i for i in items if i.payload.get("copied_from")]
    history = [i for i in api.transcript(source) if i.turn == 0]
    if [(i.kind, i.call_id, i.payload["copied_from"].get("task")) for i in copied] != [
        ("message" if i.kind == "final" else i.kind, i.call_id, source) for i in history
    ]:
        out.append(
            f"I26: {fork_id}: {len(copied)} copied items, the source's turn 0 has {len(history)}"
        )
    return out


def charlie_children(task_id: str) -> list[str]:
    from charlie.runtime import get_runtime
    from charlie.scheduler import descendants

    return descendants(get_runtime().engine, task_id)


if __name__ == "__main__":
    sys.exit(main())
