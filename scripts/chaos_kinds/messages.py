"""Fault kind: messages to running tasks (I22): sent at a drawn turn or while queued, some twice
with the same id, some after the task finished; and their checker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chaos_kinds.person import Person

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from chaos_kinds.harness import PERSON, SLACK, Plan, terminal


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


class PersonMessages:
    """The person's messages: sends and resends, and the late ones."""

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
