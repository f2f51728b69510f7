"""Fault kind: forks of finished tasks (I26): a fork runs no tool call of its source again."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from chaos_kinds.harness import MAX_MESSAGES, PERSON, Plan, _expect_turn


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


class PersonForks:
    """The person's forks of finished tasks."""

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
