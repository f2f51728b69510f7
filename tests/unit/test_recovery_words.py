"""How a recovered call and a retried model call are said (charlie/views.py, the CLI's watch):
one duration for a call everywhere, a recovery named by its kind with the worker that died
and the one (or the person) that settled it."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from charlie.api import CallRecord
from charlie.streams.base import StreamEvent
from charlie.views import call_took, recovery

pytestmark = pytest.mark.backend_free

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def record(**changes: object) -> CallRecord:
    base = CallRecord(
        call_id="c1",
        turn=1,
        index=0,
        name="idempotent_write",
        arguments={},
        effect="write",
        state="settled",
        outcome="ok",
        result={"written": "k"},
        queued_at=T0,
        dispatch_version=1,
        started_at=T0,
        started_by="w1",
        settled_at=T0 + timedelta(seconds=14.5),
        settled_by="w1",
        finish_order=1,
        duration_ms=1.0,
        attempts=1,
        handle=None,
        late_reports=0,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_an_ordinary_call_is_not_recovered_and_takes_start_to_settle() -> None:
    call = record()
    assert recovery(call) is None and call_took(call) == "14.5 s"


def test_a_reconciled_call_names_both_workers_and_keeps_its_duration() -> None:
    call = record(
        result={"written": "k", "reconciled": True, "evidence": {"started_by": "w1"}},
        started_by="w1",
        settled_by="w2",
        duration_ms=1.0,  # the reconcile hook's own time: not the call's
    )
    found = recovery(call)
    assert found is not None and found.badge == "reconciled"
    assert (found.lost, found.settled) == ("w1", "w2")
    assert "its worker w1 stopped" in found.why and "w2 ran its reconcile hook" in found.why
    assert call_took(call) == "14.5 s"


def test_an_interrupted_call() -> None:
    call = record(outcome="interrupted", result={"started_by": "w1"}, settled_by="beat")
    found = recovery(call)
    assert found is not None and found.badge == "interrupted" and found.lost == "w1"


def test_a_call_decided_by_a_person_says_how_long_it_ran_and_was_held() -> None:
    held_at = T0 + timedelta(seconds=2)
    call = record(
        settled_by="operator:ui:ana",
        hold_info={"held_at": held_at.isoformat()},
        duration_ms=None,
    )
    found = recovery(call)
    assert found is not None and found.badge == "decided by a person"
    assert found.settled == "ui:ana" and found.lost == "w1"
    assert call_took(call) == "2.0 s, held 12.5 s"


def test_a_repeated_read() -> None:
    call = record(name="read_file", effect="read", attempts=2, started_by="w2")
    found = recovery(call)
    assert found is not None and found.badge == "repeated" and found.settled == "w2"
    assert "run 2 times" in found.why


def test_watch_says_a_model_call_is_retried(capsys: pytest.CaptureFixture[str]) -> None:
    from charlie.cli import _Watch

    event = StreamEvent(
        "1-0",
        {
            "type": "retrying",
            "error": "openai:x: HTTP 503: overloaded",
            "attempts": 5,
            "next_at": "2026-01-01T00:00:04+00:00",
            "until": "2026-01-01T00:10:00+00:00",
        },
    )
    _Watch(offsets=False).show(event)
    line = capsys.readouterr().out
    assert "retrying the model call: 5 attempts failed" in line
    assert "next attempt at 00:00:04 UTC, gives up at 00:10:00 UTC" in line
    assert "last error: openai:x: HTTP 503: overloaded" in line


def test_the_demo_says_who_saw_a_devbox_command_end() -> None:
    """The demo's line for a command: the worker that saw it end, in plain words (it said
    "parked, then observed to its end by vm:11369")."""
    from charlie.demo.run import _details

    result = {"execution_id": "e1", "observed_by": "w2", "status": "exited", "exit_code": 0}
    line = " ".join(_details(record(name="run_command", result=result)))
    assert "worker w2 saw it end" in line and "parked" not in line, line
    resumed = " ".join(_details(record(name="run_command", result={**result, "resumed": True})))
    assert "while no worker waited for it; worker w2 saw it end" in resumed, resumed
