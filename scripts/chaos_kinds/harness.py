"""The chaos round's shared harness: the people's and the scripts' constants, a task's plan
(:class:`Plan`, :func:`task_script`: which tools, which people's parts), and the reads every
checker shares.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


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


def charlie_children(task_id: str) -> list[str]:
    from charlie.runtime import get_runtime
    from charlie.scheduler import descendants

    return descendants(get_runtime().engine, task_id)
