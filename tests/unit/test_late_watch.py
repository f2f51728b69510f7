"""The late watch's pacing (I13): how often an overdue wait's outside work is looked at."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from charlie.store.calls import due_for_a_look

SETTLED = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
STALL = timedelta(seconds=5)


def test_a_wait_never_looked_at_is_due_at_once() -> None:
    assert due_for_a_look(SETTLED, None, SETTLED + timedelta(seconds=1), STALL)


def test_young_waits_are_looked_at_every_stall_period() -> None:
    now = SETTLED + timedelta(seconds=30)
    assert not due_for_a_look(SETTLED, now - timedelta(seconds=4), now, STALL)
    assert due_for_a_look(SETTLED, now - timedelta(seconds=5), now, STALL)


def test_older_waits_are_looked_at_every_tenth_of_their_age() -> None:
    now = SETTLED + timedelta(minutes=30)  # a tenth of its age: three minutes
    assert not due_for_a_look(SETTLED, now - timedelta(minutes=2), now, STALL)
    assert due_for_a_look(SETTLED, now - timedelta(minutes=3), now, STALL)


def test_an_hour_of_watching_takes_tens_of_looks_not_hundreds() -> None:
    now, looked, looks = SETTLED, None, 0
    while now < SETTLED + timedelta(hours=1):
        if due_for_a_look(SETTLED, looked, now, STALL):
            looked, looks = now, looks + 1
        now += timedelta(seconds=1)  # one sweep a second
    assert 40 <= looks <= 70, looks  # one per stall period throughout would be 720
