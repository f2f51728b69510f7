"""A task's priority mapped onto the broker's message priorities (charlie/config.py,
broker_priority and Settings.broker_priorities): pure, no backend."""

from __future__ import annotations

import pytest

from charlie.config import (
    PRIORITY_RANGE,
    REDIS_PRIORITY_STEPS,
    TICK_QUEUE,
    broker_priority,
    load_settings,
    queue_mismatch_hint,
)

REDIS = tuple(reversed(REDIS_PRIORITY_STEPS))  # taken last first: 9, 6, 3, 0
RABBIT = tuple(range(11))  # x-max-priority 10


def rank(levels: tuple[int, ...], priority: int) -> int:
    """Where the broker takes a message of this priority: 0 last, higher first."""
    level = broker_priority(priority, levels)
    assert level is not None
    return levels.index(level)


@pytest.mark.parametrize("levels", [REDIS, RABBIT, (0, 1), (0, 1, 2), tuple(range(256))])
def test_higher_priority_is_never_taken_later(levels: tuple[int, ...]) -> None:
    ranks = [rank(levels, p) for p in range(-PRIORITY_RANGE, PRIORITY_RANGE + 1)]
    assert ranks == sorted(ranks)
    assert ranks[0] == 0 and ranks[-1] == len(levels) - 1


@pytest.mark.parametrize("levels", [REDIS, RABBIT, (0, 1, 2), tuple(range(256))])
def test_any_priority_but_the_default_leaves_the_default_level(levels: tuple[int, ...]) -> None:
    # what users write (1, 10, -1): any of them is ordered against the default's messages
    default = rank(levels, 0)
    for p in (1, 10, 100, PRIORITY_RANGE):
        assert rank(levels, p) > default
    for p in (-1, -10, -100, -PRIORITY_RANGE):
        assert rank(levels, p) < default


def test_on_redis_the_default_is_below_the_level_of_messages_without_one() -> None:
    # Redis takes step 0 first, and a message published without a priority lands there (the
    # intake's charlie.submit, a sweep's message, a worker of an earlier release): the
    # default priority is not that level, else no task could go before the default's bulk.
    assert broker_priority(0, REDIS) == 6
    assert broker_priority(1, REDIS) == 3
    assert broker_priority(PRIORITY_RANGE, REDIS) == 0
    assert broker_priority(-1, REDIS) == 9


def test_on_rabbitmq_the_default_is_the_middle() -> None:
    # RabbitMQ takes the highest first; a message without a priority counts as 0, the lowest
    assert broker_priority(0, RABBIT) == 5
    assert broker_priority(PRIORITY_RANGE, RABBIT) == 10
    assert broker_priority(-PRIORITY_RANGE, RABBIT) == 0


def test_out_of_range_priorities_are_bounded() -> None:
    assert broker_priority(10**6, RABBIT) == 10
    assert broker_priority(-(10**6), RABBIT) == 0


def test_a_broker_without_priorities_gets_none() -> None:
    assert broker_priority(10, ()) is None


def test_which_brokers_have_priorities(monkeypatch: pytest.MonkeyPatch) -> None:
    # Redis: an opt-in too (it cost throughput against a provider limit, see config)
    monkeypatch.delenv("CHARLIE_REDIS_PRIORITIES", raising=False)
    assert load_settings_with(monkeypatch, "redis://127.0.0.1:6379/0") == ()
    monkeypatch.setenv("CHARLIE_REDIS_PRIORITIES", "1")
    assert load_settings_with(monkeypatch, "redis://127.0.0.1:6379/0") == (9, 6, 3, 0)
    monkeypatch.delenv("CHARLIE_REDIS_PRIORITIES")
    assert load_settings_with(monkeypatch, "charliefs://") == ()
    # RabbitMQ: an opt-in, since the queue must be declared with x-max-priority
    assert load_settings_with(monkeypatch, "amqp://guest@127.0.0.1//") == ()
    assert load_settings_with(monkeypatch, "amqp://guest@127.0.0.1//", "4") == (0, 1, 2, 3, 4)
    # the setting means nothing to another broker
    assert load_settings_with(monkeypatch, "charliefs://", "4") == ()


def load_settings_with(
    monkeypatch: pytest.MonkeyPatch, url: str, max_priority: str = ""
) -> tuple[int, ...]:
    monkeypatch.setenv("CHARLIE_BROKER_URL", url)
    monkeypatch.setenv("CHARLIE_RABBITMQ_MAX_PRIORITY", max_priority)
    return load_settings().broker_priorities


@pytest.mark.parametrize("raw", ["256", "-1", "ten"])
def test_a_max_priority_rabbitmq_refuses_is_refused_here(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv("CHARLIE_RABBITMQ_MAX_PRIORITY", raw)
    with pytest.raises(ValueError, match="CHARLIE_RABBITMQ_MAX_PRIORITY"):
        load_settings()


def test_a_queue_declared_otherwise_is_named_with_what_to_do() -> None:
    refused = Exception(
        "Queue.declare: (406) PRECONDITION_FAILED - inequivalent arg 'x-max-priority' for "
        "queue 'charlie' in vhost '/': received the value '10' of type 'signedint' but "
        "current is none"
    )
    hint = queue_mismatch_hint(refused)
    assert "CHARLIE_RABBITMQ_MAX_PRIORITY" in hint and f"delete the queue ({TICK_QUEUE!r}" in hint
    assert queue_mismatch_hint(Exception("(406) PRECONDITION_FAILED - x-queue-type")) == ""
    assert queue_mismatch_hint(ConnectionRefusedError("refused")) == ""
