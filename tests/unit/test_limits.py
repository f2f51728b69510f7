"""CHARLIE_MODEL_LIMITS read and decided (charlie/limits.py, pure), and a 429 told to the fleet
by the retry policy (charlie/models/retry.py): no backend."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from charlie.limits import Counted, Limit, LimitsError, decide, limit_for, parse_limits
from charlie.models.base import TransientModelError
from charlie.models.retry import Failure, RetryPolicy

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
FALLBACK = timedelta(seconds=5)


def counted(**values: object) -> Counted:
    base: dict[str, object] = {
        "now": NOW,
        "in_flight": 0,
        "recent": 0,
        "recent_tokens": 0,
        "oldest": None,
        "ahead": 0,
        "waiting": 0,
        "paused_until": None,
    }
    base.update(values)
    return Counted(**base)  # type: ignore[arg-type]


def test_limits_parse_inline_or_from_a_file_and_match_by_prefix(tmp_path: Path) -> None:
    inline = '{"openai:": {"concurrency": 4, "rpm": 600}, "openai:gpt-4.1": {"tpm": 1000}}'
    table = parse_limits(inline)
    assert limit_for("openai:gpt-4.1", table) == Limit("openai:gpt-4.1", tpm=1000)
    assert limit_for("openai:gpt-4o-mini", table) == Limit("openai:", 4, 600)
    assert limit_for("anthropic:claude-x", table) is None
    path = tmp_path / "limits.json"
    path.write_text('{"anthropic:claude-": {"concurrency": 2}}')
    assert limit_for("anthropic:claude-sonnet", parse_limits(str(path))) is not None
    assert parse_limits(None) == {} and parse_limits("  ") == {}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"openai:": {"rps": 3}}', "unknown key(s) rps"),
        ('{"openai:": {"concurrency": 0}}', "whole number of 1 or more"),
        ('{"openai:": {"rpm": 1.5}}', "whole number of 1 or more"),
        ('{"openai:": {"rpm": true}}', "must be a whole number"),
        ('{"openai:": {}}', "must be an object like"),
        ('{"openai:": 3}', "must be an object like"),
        ("{nope", "not valid JSON"),
        ("/no/such/file.json", "neither a JSON object nor a readable file"),
    ],
)
def test_a_limits_table_that_cannot_be_used_names_the_setting(raw: str, message: str) -> None:
    with pytest.raises(LimitsError, match="CHARLIE_MODEL_LIMITS") as caught:
        parse_limits(raw)
    assert message in str(caught.value)


def test_a_call_goes_while_there_is_room_for_it_and_those_ahead() -> None:
    limit = Limit("openai:", concurrency=2)
    assert decide(limit, counted(in_flight=1), 10, FALLBACK).wake_at is None
    full = decide(limit, counted(in_flight=2), 10, FALLBACK)
    assert full.wake_at == NOW + FALLBACK
    # one free slot, one caller ahead: the slot is theirs (fair order)
    assert decide(limit, counted(in_flight=1, ahead=1), 10, FALLBACK).wake_at is not None
    assert decide(limit, counted(in_flight=0, ahead=1), 10, FALLBACK).wake_at is None


def test_a_waiting_caller_wakes_those_ahead_only_for_room_not_yet_promised() -> None:
    """Room free while callers ahead sleep is woken for once (I30): callers woken lately hold
    it, so a caller looking again behind them wakes no more than the room left."""
    limit = Limit("openai:", concurrency=4)
    # four free slots, ten ahead, none woken yet: wake four
    assert decide(limit, counted(ahead=10), 10, FALLBACK).wake_ahead == 4
    # three of them already woken and on their way: one more
    assert decide(limit, counted(ahead=10, woken=3), 10, FALLBACK).wake_ahead == 1
    # the room is all promised: none (waking more only sends ticks that wait again)
    assert decide(limit, counted(ahead=10, woken=4), 10, FALLBACK).wake_ahead == 0
    assert decide(limit, counted(in_flight=2, ahead=10, woken=2), 10, FALLBACK).wake_ahead == 0
    # the woken callers' own looks go: the room is theirs
    assert decide(limit, counted(ahead=3, woken=3), 10, FALLBACK).wake_at is None


def test_rpm_and_tpm_wait_for_the_oldest_request_to_leave_the_window() -> None:
    oldest = NOW - timedelta(seconds=30)
    rpm = decide(Limit("k", rpm=3), counted(recent=3, oldest=oldest), 10, FALLBACK)
    assert rpm.wake_at == oldest + timedelta(seconds=61)
    tpm = Limit("k", tpm=1000)
    assert decide(tpm, counted(recent_tokens=900, oldest=oldest), 200, FALLBACK).wake_at
    assert decide(tpm, counted(recent_tokens=700, oldest=oldest), 200, FALLBACK).wake_at is None
    # a request larger than the whole limit still goes, alone
    assert decide(tpm, counted(), 5000, FALLBACK).wake_at is None


def test_room_under_tokens_per_minute_is_given_in_line_order() -> None:
    """I30: a newcomer of 100 tokens that fits (400 of 1,000 counted) does not pass a caller
    of 900 waiting ahead of it for the minute; alone in line, it goes."""
    oldest = NOW - timedelta(seconds=30)
    tpm = Limit("k", tpm=1000)
    behind = decide(tpm, counted(recent_tokens=400, oldest=oldest, ahead=1), 100, FALLBACK)
    assert behind.wake_at is not None and behind.reason == "tokens/min"
    assert NOW < behind.wake_at <= NOW + 2 * FALLBACK  # a lease a place in line
    alone = decide(tpm, counted(recent_tokens=400, oldest=oldest), 100, FALLBACK)
    assert alone.wake_at is None
    # so with every kind of limit, and with several at once
    both = Limit("k", concurrency=4, tpm=1000)
    assert decide(both, counted(recent_tokens=400, ahead=1), 100, FALLBACK).wake_at is not None
    rpm = Limit("k", rpm=10)
    assert decide(rpm, counted(recent=8, oldest=oldest, ahead=2), 1, FALLBACK).wake_at
    assert decide(rpm, counted(recent=7, oldest=oldest, ahead=2), 1, FALLBACK).wake_at is None


def test_a_pause_the_provider_asked_for_holds_every_call() -> None:
    until = NOW + timedelta(seconds=3)
    verdict = decide(Limit("k", concurrency=9), counted(paused_until=until), 1, FALLBACK)
    assert verdict.wake_at == until
    past = decide(Limit("k", concurrency=9), counted(paused_until=NOW), 1, FALLBACK)
    assert past.wake_at is None


def test_the_retry_policy_tells_the_fleet_of_a_429_before_it_waits() -> None:
    told: list[float] = []
    slept: list[float] = []
    answers = iter([Failure("429", {}, 429, retry_after=2.0), "ok"])
    policy = RetryPolicy(sleep=slept.append)
    out = policy.run(
        lambda: next(answers),
        spec="openai:x",
        log=logging.getLogger("test"),
        extra={},
        throttled=told.append,
    )
    assert out == "ok" and told == [2.0] and slept == [2.0]
    # a 529 (Anthropic's overloaded) too, even when it is the last attempt; a 500 is not load
    told.clear()
    policy = RetryPolicy(max_attempts=1, sleep=slept.append)
    with pytest.raises(TransientModelError):
        policy.run(
            lambda: Failure("529", {}, 529, retry_after=7.0),
            spec="anthropic:x",
            log=logging.getLogger("test"),
            extra={},
            throttled=told.append,
        )
    assert told == [7.0]
    told.clear()
    with pytest.raises(TransientModelError):
        policy.run(
            lambda: Failure("500", {}, 500, retry_after=1.0),
            spec="openai:x",
            log=logging.getLogger("test"),
            extra={},
            throttled=told.append,
        )
    assert told == []
