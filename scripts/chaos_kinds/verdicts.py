"""Fault kind: verdicts on held calls (I23, I24, I27): approve or deny, reconcile an interrupted
``held_write`` from the ledger, a second verdict on some calls, cancel; and their checkers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chaos_kinds.person import Person

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from chaos_kinds.harness import PERSON, WRITE_EVENTS, Plan, ledger_entries


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


class PersonVerdicts:
    """The person's verdicts, second attempts and cancels."""

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
