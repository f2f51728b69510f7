"""The person thread: the people's parts of every fault kind (messages, verdicts, holding back,
forks: each kind's module holds its part as a mixin), scheduled and run on one thread.
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from chaos_kinds.forks import PersonForks
from chaos_kinds.harness import Plan, all_tasks, terminal
from chaos_kinds.messages import PersonMessages, Sent
from chaos_kinds.verdicts import PersonVerdicts, Second, Verdict
from chaos_kinds.waiting import PersonWaiting


class Person(PersonMessages, PersonVerdicts, PersonWaiting, PersonForks, threading.Thread):
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
