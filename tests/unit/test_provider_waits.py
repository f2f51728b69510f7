"""A provider's wait is parsed without raising and bounded (CHARLIE_MODEL_RETRY_AFTER_MAX):
``Retry-After`` in seconds or as an HTTP date, ``retry-after-ms`` and the rate-limit reset
headers; and the doctor's checks of what a provider paused and who may act through the broker."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

import pytest

from charlie.config import load_settings
from charlie.doctor import broker_is_loopback, paused_limits, unsigned_broker_actions
from charlie.models.retry import parse_retry_after, provider_wait, retry_after_max

pytestmark = pytest.mark.backend_free

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    "value",
    [
        "100000000",  # three years
        "1" + "0" * 400,  # too large for a float
        "1e400",
        "9" * 5000,
        "Fri, 31 Dec 9999 23:59:59 GMT",
    ],
)
def test_a_huge_wait_is_capped_never_raised(value: str) -> None:
    for header in ("retry-after", "retry-after-ms"):
        wait = provider_wait({header: value}, NOW, cap=600)
        if header == "retry-after-ms" and not value[0].isdigit():
            assert wait is None
            continue
        assert wait is not None and wait.seconds == 600 and wait.capped, (header, value)
        assert wait.header == header and len(wait.value) <= 80
        # what every wait is used for: a time to wake at
        assert NOW + timedelta(seconds=wait.seconds) <= NOW + timedelta(seconds=600)


def test_the_usual_waits_are_read_as_before() -> None:
    assert provider_wait({"retry-after": "7"}, NOW).seconds == 7  # type: ignore[union-attr]
    assert provider_wait({"retry-after": "-3"}, NOW).seconds == 0  # type: ignore[union-attr]
    assert provider_wait({"retry-after-ms": "250", "retry-after": "9"}, NOW).seconds == 0.25  # type: ignore[union-attr]
    http_date = {"retry-after": "Thu, 01 Jan 2026 12:01:30 GMT"}
    assert provider_wait(http_date, NOW).seconds == 90  # type: ignore[union-attr]
    for nothing in ({}, {"retry-after": "whenever"}, {"retry-after": "nan"}, {"retry-after": ""}):
        assert provider_wait(nothing, NOW) is None


def test_the_rate_limit_reset_headers_give_a_wait_when_retry_after_does_not() -> None:
    openai = {
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "6m0s",
        "x-ratelimit-remaining-tokens": "5000",
        "x-ratelimit-reset-tokens": "20ms",
    }
    wait = provider_wait(openai, NOW)
    assert wait is not None and wait.seconds == 360 and wait.header == "x-ratelimit-reset-requests"
    anthropic = {
        "anthropic-ratelimit-tokens-reset": "2026-01-01T12:00:42Z",
        "anthropic-ratelimit-tokens-remaining": "0",
    }
    assert provider_wait(anthropic, NOW).seconds == 42  # type: ignore[union-attr]
    epoch = {"x-ratelimit-reset": str(int(NOW.timestamp()) + 15), "x-ratelimit-remaining": "0"}
    assert provider_wait(epoch, NOW).seconds == 15  # type: ignore[union-attr]
    far = {"ratelimit-reset": "1e30", "ratelimit-remaining": "0"}
    assert provider_wait(far, NOW, cap=60).seconds == 60  # type: ignore[union-attr]
    # a reset alone (every answer carries one) or of a limit not run out is no wait
    assert provider_wait({"ratelimit-reset": "30"}, NOW) is None
    assert provider_wait({"ratelimit-reset": "30", "ratelimit-remaining": "12"}, NOW) is None
    # a Retry-After says it first
    assert provider_wait({**openai, "retry-after": "2"}, NOW).seconds == 2  # type: ignore[union-attr]


def test_the_cap_is_the_setting_and_a_capped_wait_is_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("CHARLIE_MODEL_RETRY_AFTER_MAX", raising=False)
    assert retry_after_max() == 600
    assert load_settings().model_retry_after_max == 600
    monkeypatch.setenv("CHARLIE_MODEL_RETRY_AFTER_MAX", "30")
    assert load_settings().model_retry_after_max == 30
    with caplog.at_level(logging.WARNING, logger="charlie.models.retry"):
        assert parse_retry_after({"retry-after": "100000000"}) == 30
        assert parse_retry_after({"retry-after": "12"}) == 12
    [record] = caplog.records
    assert record.provider_value == "100000000"  # type: ignore[attr-defined]
    assert record.provider_header == "retry-after"  # type: ignore[attr-defined]
    assert "100000000" in record.getMessage()
    for bad in ("0", "-1", "inf", "soon"):
        monkeypatch.setenv("CHARLIE_MODEL_RETRY_AFTER_MAX", bad)
        with pytest.raises(ValueError, match="CHARLIE_MODEL_RETRY_AFTER_MAX"):
            load_settings()


def test_a_providers_text_is_quoted_on_one_printable_line() -> None:
    wait = provider_wait({"retry-after": "Fri, 31 Dec 9999 23:59:59 GMT\x1b[2J"}, NOW)
    assert wait is None or "\x1b" not in wait.value


@dataclass
class _Status:
    key: str
    paused_until: datetime | None
    in_flight: int = 1
    waiting: int = 3


def test_doctor_warns_of_each_paused_limit_and_says_how_to_lift_it() -> None:
    checks = paused_limits(
        [
            _Status("openai:", NOW + timedelta(seconds=300)),
            _Status("anthropic:", NOW - timedelta(seconds=5)),
            _Status("other", None),
        ],
        NOW,
    )
    [check] = checks
    assert check.status == "WARN" and "openai:" in check.detail and "300 s left" in check.detail
    assert "charlie limits resume openai:" in check.fix


@pytest.mark.parametrize(
    ("url", "local"),
    [
        ("charliefs://", True),
        ("redis://127.0.0.1:6379/0", True),
        ("redis://localhost/1", True),
        ("amqp://guest:guest@[::1]:5672//", True),
        ("redis://10.0.0.5:6379/0", False),
        ("amqp://u:p@rabbit:5672/v", False),
        ("redis://127.0.0.1:6379/0;redis://10.1.1.1:6379/0", False),
    ],
)
def test_a_broker_on_loopback_is_told_apart(url: str, local: bool) -> None:
    assert broker_is_loopback(url) is local


def test_doctor_warns_when_anyone_on_a_shared_broker_can_act(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("KEY", "CERTIFICATE", "CERT_STORE"):
        monkeypatch.delenv(f"CHARLIE_SECURITY_{name}", raising=False)
    monkeypatch.delenv("CHARLIE_CELERY_OPERATOR_ACTIONS", raising=False)
    s = replace(load_settings(), broker_url="redis://:secret@10.0.0.5:6379/0")
    check = unsigned_broker_actions(s)
    assert check is not None and check.status == "WARN"
    assert "CHARLIE_CELERY_OPERATOR_ACTIONS=0" in check.fix and "sign" in check.fix
    assert "secret" not in check.detail
    assert unsigned_broker_actions(replace(s, broker_url="redis://127.0.0.1:6379/0")) is None
    assert unsigned_broker_actions(replace(s, celery_operator_actions=False)) is None
