"""The run-wide checker: every task's end, its calls and results (I7, I8, I10), delegations
(I19), what the kills caught, then each fault kind's checker; the table it prints.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter, defaultdict

from chaos_kinds.forks import check_fork
from chaos_kinds.harness import WRITE_EVENTS, Plan, charlie_children, pct
from chaos_kinds.kills import Killer
from chaos_kinds.messages import check_messages
from chaos_kinds.person import Person
from chaos_kinds.verdicts import check_actions, check_verdicts


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
