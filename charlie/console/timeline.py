"""The run as a picture: phases and tool calls over time, one lane per worker.

Built from the transitions table (``api.history``: each move's from and to phase, when it
committed, which worker, how long its tick took, I21) and the call records (``api.calls``:
started, settled, by whom, with what outcome). The top lane is the run itself: the phase it
was in between two transitions, so a stall is a long bar no worker lane explains; each worker
lane shows the ticks it ran and the calls it held, so a killed worker's call is a red bar that
ends when a sweep settled it, and the recovery is the next tick in another lane. A model call
being retried (I36) shows its latest failed tries and the waits after them, hatched, on the
lanes of the workers that tried, up to the next attempt's time. Operators' actions are
diamonds in a lane of their own.

This module computes geometry only; the template draws it, escaping every text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from charlie import api
from charlie.console.rows import (
    OUTCOME_LABELS,
    clock,
    decided_by,
    verdicts_of,
)
from charlie.models.retrying import KEPT_WAITS, Retrying, Wait, attempts_failed
from charlie.views import PERSON_PREFIX, call_took, recovery, span

WIDTH = 1000
LABEL = 150
LANE = 22
TOP = 22
#: the narrowest a mark is drawn, so a one-millisecond tick is still seen
MIN_WIDTH = 1.5


@dataclass(frozen=True)
class Mark:
    x: float
    y: float
    w: float
    h: float
    css: str
    title: str
    label: str = ""


@dataclass(frozen=True)
class Point:
    x: float
    y: float
    css: str
    title: str


@dataclass(frozen=True)
class Lane:
    y: float
    label: str
    title: str


@dataclass(frozen=True)
class Tick:
    x: float
    label: str


@dataclass
class Timeline:
    width: int
    height: int
    lanes: list[Lane] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    points: list[Point] = field(default_factory=list)
    ticks: list[Tick] = field(default_factory=list)
    legend: list[tuple[str, str]] = field(default_factory=list)
    total: str = ""


def _step(seconds: float) -> float:
    for s in (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200):
        if seconds / s <= 10:
            return s
    return 21600.0


def _tick_label(offset: float) -> str:
    if offset >= 3600:
        return f"{offset / 3600:g} h"
    if offset >= 60:
        return f"{offset / 60:g} min"
    return f"{offset:g} s"


def build(
    info: api.TaskInfo,
    history: list[dict[str, Any]],
    calls: list[api.CallRecord],
    actions: list[api.ActionRecord],
    now: datetime,
) -> Timeline:
    moments: list[datetime] = [info.created_at]
    moments += [t["at"] for t in history if t.get("at") is not None]
    for c in calls:
        moments += [m for m in (c.queued_at, c.started_at, c.settled_at) if m is not None]
    moments += [a.at for a in actions]
    start = min(moments)
    end = info.finished_at if info.terminal and info.finished_at else now
    end = max([end, *moments])
    # a retried model call's waits (I36), drawn to the next attempt's time, which may be
    # ahead of now: the picture reaches it
    waits = info.retrying.waits if info.retrying is not None and not info.terminal else ()
    horizon = max([end, *(w.next_at for w in waits)])
    total = max((horizon - start).total_seconds(), 0.001)
    scale = (WIDTH - LABEL - 10) / total

    def x(at: datetime) -> float:
        return LABEL + (at - start).total_seconds() * scale

    workers: list[str] = []
    # A transition a person made (a resume: its worker is recorded as ``operator:NAME``) is
    # drawn in the people lane, not in a lane of its own named like a worker.
    by_person = False
    for t in history:
        worker = str(t.get("worker") or "")
        if worker.startswith(PERSON_PREFIX):
            by_person = True
        elif worker and worker not in workers:
            workers.append(worker)
    for c in calls:
        if c.started_by and c.started_by not in workers:
            workers.append(c.started_by)
    # a recovered call is marked on the lane of the worker that died holding it and on the
    # lane of the one that settled it, so both ends of the recovery are in the picture
    recovered = {(c.turn, c.call_id): r for c in calls if (r := recovery(c)) is not None}
    for r in recovered.values():
        # (a person who decided one is in the people lane)
        by_worker = r.settled if r.badge != "decided by a person" else None
        for name in (r.lost, by_worker):
            if name and not name.startswith(PERSON_PREFIX) and name not in workers:
                workers.append(name)
    for wait in waits:
        if wait.worker and wait.worker not in workers:
            workers.append(wait.worker)
    people_needed = by_person or bool(actions) or any(c.hold or c.hold_info for c in calls)
    names = ["run", *workers] + (["people"] if people_needed else [])
    lane_y = {name: TOP + n * LANE for n, name in enumerate(names)}
    tl = Timeline(width=WIDTH, height=TOP + len(names) * LANE + 6)
    for name in names:
        title = {
            "run": "the phase the run was in between two transitions",
            "people": "operators' actions, and calls a person decided",
        }.get(name, f"worker {name}: the ticks it ran and the calls it held")
        tl.lanes.append(Lane(lane_y[name], name if len(name) <= 22 else name[:21] + "…", title))

    # the run lane: from each transition to the next, the phase it moved to
    phase, since = "load_context", info.created_at
    for t in history:
        at = t["at"]
        began = at
        if t.get("duration_ms"):
            began = at - timedelta(milliseconds=float(t["duration_ms"]))
        _run_mark(tl, x, lane_y["run"], phase, since, max(since, began), "waiting in")
        phase, since = str(t["to_phase"]), at
        # the tick itself, in its worker's lane (a person's, in the people lane)
        worker = str(t.get("worker") or "")
        lane = worker
        if worker.startswith(PERSON_PREFIX):
            lane, worker = "people", worker[len(PERSON_PREFIX) :]
        if lane in lane_y:
            w = max(x(at) - x(began), MIN_WIDTH)
            tl.marks.append(
                Mark(
                    x(began),
                    lane_y[lane] + 3,
                    w,
                    LANE - 8,
                    f"phase phase-{t['from_phase']}",
                    f"{t['from_phase']} → {t['to_phase']} (v{t.get('version')}) by {worker} "
                    f"at {clock(at)}, {span(t.get('duration_ms'))}"
                    + (f": {t['note']}" if t.get("note") else ""),
                )
            )
    if phase != "done":
        _run_mark(tl, x, lane_y["run"], phase, since, end, "in")

    plans = sorted(
        t["at"]
        for t in history
        if t.get("from_phase") == "call_model" and t.get("to_phase") == "dispatch_tools"
    )
    verdicts: dict[tuple[str, int], datetime] = {}
    settled_by_person = verdicts_of(actions)  # who, and how it arrived (I32)
    for a in actions:
        if a.call_id is not None and a.turn is not None:
            verdicts.setdefault((a.call_id, a.turn), a.at)
    for c in calls:
        label = OUTCOME_LABELS.get(c.outcome or "", c.outcome or c.state)
        info_ = c.hold_info if isinstance(c.hold_info, dict) else {}
        held_at = _parse(info_.get("held_at"))
        if c.started_at is not None and c.started_by in lane_y:
            # a call held after its worker was lost ends, on that worker's lane, where the
            # sweep found it; the wait for a person that followed is in the people lane
            until = held_at or c.settled_at or end
            outcome = "interrupted" if held_at else (c.outcome or "open")
            css = f"call outcome-{outcome}"
            if (c.turn, c.call_id) in recovered:
                css += " recovered"  # outlined: not an ordinary bar of its outcome
            title = (
                f"{c.name} ({c.call_id}, turn {c.turn}): {label}, {call_took(c)}; started "
                f"{clock(c.started_at)} "
                f"by {c.started_by}, settled {clock(c.settled_at)} "
                + (
                    decided_by(c, settled_by_person.get((c.turn, c.call_id)))
                    or f"by {c.settled_by or '-'}"
                )
            )
            if held_at:
                title += f"; interrupted and held for a verdict at {clock(held_at)}"
            if c.late_reports:
                title += f"; late report: {(c.late_result or {}).get('outcome')}"
            bar = max(x(until) - x(c.started_at), MIN_WIDTH)
            fits = int(bar / 6)
            name = "" if fits < 4 else (c.name if len(c.name) <= fits else c.name[: fits - 1] + "…")
            tl.marks.append(
                Mark(x(c.started_at), lane_y[c.started_by] + 9, bar, LANE - 14, css, title, name)
            )
            if outcome == "interrupted":
                tl.points.append(
                    Point(x(until), lane_y[c.started_by] + LANE / 2 + 2, "kill", title)
                )
        if "people" not in lane_y:
            continue
        asked = info_.get("why") or info_.get("question") is not None
        if held_at is not None or asked or c.hold:
            if held_at is not None:
                since = held_at
            else:
                known = c.queued_at or c.settled_at or end
                since = max((p for p in plans if p <= known), default=info.created_at)
            decided = verdicts.get((c.call_id, c.turn)) or c.settled_at or end
            if c.hold:  # still waiting
                decided = end
            needs = {"approval": "an approval", "reply": "a reply", "reconcile": "a verdict"}
            kind = c.hold or (
                "reconcile" if held_at else ("reply" if "question" in info_ else "approval")
            )
            tl.marks.append(
                Mark(
                    x(since),
                    lane_y["people"] + 7,
                    max(x(decided) - x(since), MIN_WIDTH),
                    LANE - 12,
                    "held",
                    f"{c.name} ({c.call_id}) waited for {needs.get(kind, kind)} from "
                    f"{clock(since)}" + ("" if c.hold else f" to {clock(decided)}: {label}"),
                )
            )
    for a in actions:
        what = a.describe() + (f" — call {a.call_id}" if a.call_id else "")
        tl.points.append(Point(x(a.at), lane_y["people"] + LANE / 2, "action", what))
    for c in calls:
        r = recovered.get((c.turn, c.call_id))
        if r is None:
            continue
        title = f"recovered ({r.badge}): {c.name} ({c.call_id}, turn {c.turn}): {r.why}"
        held_at = _parse(
            (c.hold_info or {}).get("held_at") if isinstance(c.hold_info, dict) else None
        )
        found = held_at or c.settled_at or end
        settled = c.settled_at or end
        if r.badge == "repeated":
            found = settled = c.started_at or settled
        if r.lost in lane_y:
            tl.points.append(Point(x(found), lane_y[r.lost] + LANE / 2, "recovered", title))
        by_lane = r.settled if r.settled in lane_y else None
        if r.badge == "decided by a person" and "people" in lane_y:
            by_lane = "people"
        if by_lane is not None and by_lane != r.lost:
            tl.points.append(Point(x(settled), lane_y[by_lane] + LANE / 2, "recovered", title))

    for n, wait in enumerate(waits):
        if wait.worker in lane_y:
            _retry_marks(
                tl, x, lane_y[wait.worker], wait, waits[n - 1] if n else None, info.retrying
            )

    # a tick narrower than a few pixels is part of a texture, not something to point at: no
    # tooltip of its own (a long run's picture stays light)
    tl.marks = [
        m
        if m.w >= 3 or m.css.startswith(("call", "held", "retry"))
        else dataclasses.replace(m, title="")
        for m in _merged(tl.marks)
    ]
    step = _step(total)
    n = 0
    while n * step <= total + 1e-9 and n < 40:
        tl.ticks.append(Tick(LABEL + n * step * scale, _tick_label(n * step)))
        n += 1
    lasted = max((end - start).total_seconds(), 0.001)  # so far: not to a wait's end
    tl.total = f"{lasted:.1f} s" if lasted < 120 else f"{lasted / 60:.1f} min"
    tl.legend = [
        ("phase phase-call_model", "model call"),
        ("phase phase-await_tools", "waiting for tools"),
        ("phase phase-other", "other phases"),
        ("call outcome-ok", "tool call ok"),
        ("call outcome-error", "error"),
        ("call outcome-interrupted", "interrupted (worker lost)"),
        ("call outcome-deadline_exceeded", "deadline exceeded"),
        ("call outcome-open", "running"),
        ("held", "waiting for a person"),
    ]
    if recovered:
        # the outline says the bar is not an ordinary one of its outcome
        tl.legend.append(("call outcome-ok recovered", "recovered call (outlined)"))
    if waits:
        tl.legend += [
            ("retry-tried", "model call attempts that failed, with the backoff between"),
            ("retry-wait", "waiting to retry the model call"),
        ]
    return tl


def _retry_marks(
    tl: Timeline, x: Any, y: float, wait: Wait, before: Wait | None, retry: Retrying | None
) -> None:
    """A failed try of a retried model call (the attempts its tick made) and the wait after
    it to the next attempt, on the lane of the worker that tried; each titled with the
    attempts (the run's count, as the page's header says it) and the error, which the
    template escapes: it is the provider's text. The oldest wait kept, when older ones were
    dropped (KEPT_WAITS), starts at the first attempt it recorded, or, recorded before that
    was kept, says only where its attempts end."""
    if wait.first:
        first: int | None = wait.first
    elif before is not None:
        first = before.attempts + 1
    elif retry is not None and len(retry.waits) >= KEPT_WAITS:
        first = None  # older waits may have been dropped: where this one starts is unknown
    else:
        first = 1
    if first is None:
        tried = f"attempts up to {wait.attempts}"
    elif first == wait.attempts:
        tried = f"attempt {first}"
    else:
        tried = f"attempts {first}-{wait.attempts}"
    what = f"the model call (turn {wait.turn}) by {wait.worker}"
    tl.marks.append(
        Mark(
            x(wait.began),
            y + 9,
            max(x(wait.failed_at) - x(wait.began), MIN_WIDTH),
            LANE - 14,
            "retry-tried",
            f"{what}: {tried} failed, from {clock(wait.began)} to {clock(wait.failed_at)}: "
            f"{wait.error}",
        )
    )
    tl.marks.append(
        Mark(
            x(wait.failed_at),
            y + 7,
            max(x(wait.next_at) - x(wait.failed_at), MIN_WIDTH),
            LANE - 10,
            "retry-wait",
            f"{what}: waiting to retry after {attempts_failed(wait.attempts)}, from "
            f"{clock(wait.failed_at)} to attempt {wait.attempts + 1} at {clock(wait.next_at)}; "
            f"last error: {wait.error}",
        )
    )


def _merged(marks: list[Mark]) -> list[Mark]:
    """Marks of one kind that touch on one lane become one, so a long run's picture stays a
    few hundred shapes (a thousand ticks fit in a thousand pixels at most)."""
    out: list[Mark] = []
    groups: dict[tuple[float, str], list[Mark]] = {}
    for m in marks:
        if m.css.startswith("retry"):
            out.append(m)  # a few at most (retrying.KEPT_WAITS), each its own attempts
            continue
        groups.setdefault((m.y, m.css), []).append(m)
    for group in groups.values():
        group.sort(key=lambda m: m.x)
        current, count = group[0], 1
        for m in group[1:]:
            if m.x <= current.x + current.w + 1.0:
                end = max(current.x + current.w, m.x + m.w)
                count += 1
                title = current.title.split(" (and ")[0] + f" (and {count - 1} more like it)"
                current = Mark(current.x, current.y, end - current.x, current.h, current.css, title)
            else:
                out.append(current)
                current, count = m, 1
        out.append(current)
    return out


def _parse(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def _run_mark(
    tl: Timeline,
    x: Any,
    y: float,
    phase: str,
    since: datetime,
    until: datetime,
    how: str,
) -> None:
    seconds = (until - since).total_seconds()
    if seconds <= 0:
        return
    tl.marks.append(
        Mark(
            x(since),
            y + 3,
            max(x(until) - x(since), MIN_WIDTH),
            LANE - 8,
            f"run phase-{phase}",
            f"{how} {phase} from {clock(since)} for {seconds:.2f} s",
        )
    )
