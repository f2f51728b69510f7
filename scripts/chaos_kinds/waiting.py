"""Fault kind: many calls waiting for a person at once (I25): more questions than worker slots
wait while the person holds back every answer, and other runs must still move.
"""

from __future__ import annotations

from typing import Any

from chaos_kinds.harness import terminal


class PersonWaiting:
    """The person's holding back, and what it watches meanwhile."""

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
