"""How an action's actor is shown (I32), and the settings that decide who may act through the
broker: Celery actions on or off, message signing all or nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from charlie.config import load_settings
from charlie.domain import describe_actor


def test_an_actor_says_how_it_is_known() -> None:
    assert describe_actor("ui:alice", "ui", True) == "alice (console, signed in)"
    assert describe_actor("ui:alice", "celery", False) == "ui:alice (claimed, via celery)"
    assert describe_actor("ana", "cli", False) == "ana (claimed, via CLI)"
    assert describe_actor("ana", "api", False) == "ana (claimed, via Python API)"
    # recorded before channels were: claimed, and said so
    assert describe_actor("old", None, False) == "old (claimed, channel not recorded)"


def test_celery_operator_actions_are_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHARLIE_CELERY_OPERATOR_ACTIONS", raising=False)
    assert load_settings().celery_operator_actions is True
    monkeypatch.setenv("CHARLIE_CELERY_OPERATOR_ACTIONS", "0")
    assert load_settings().celery_operator_actions is False
    monkeypatch.setenv("CHARLIE_CELERY_OPERATOR_ACTIONS", "maybe")
    with pytest.raises(ValueError, match="CHARLIE_CELERY_OPERATOR_ACTIONS"):
        load_settings()


def test_message_signing_takes_all_three_settings_or_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("KEY", "CERTIFICATE", "CERT_STORE"):
        monkeypatch.delenv(f"CHARLIE_SECURITY_{name}", raising=False)
    assert load_settings().signs_messages is False
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    key.write_text("key")
    cert.write_text("cert")
    monkeypatch.setenv("CHARLIE_SECURITY_KEY", str(key))
    with pytest.raises(ValueError, match="CHARLIE_SECURITY_CERTIFICATE, CHARLIE_SECURITY_CERT_"):
        load_settings()
    monkeypatch.setenv("CHARLIE_SECURITY_CERTIFICATE", str(tmp_path / "missing.pem"))
    monkeypatch.setenv("CHARLIE_SECURITY_CERT_STORE", str(tmp_path))
    with pytest.raises(ValueError, match=r"missing\.pem' is not a readable file"):
        load_settings()
    monkeypatch.setenv("CHARLIE_SECURITY_CERTIFICATE", str(cert))
    s = load_settings()
    assert s.signs_messages and s.security_cert_store == str(tmp_path)


def test_a_claimed_name_cannot_hide_how_it_is_known() -> None:
    """A name a broker message claims is shown on one line, without escapes, and bounded, so
    the words that say it was claimed always follow it (in a terminal and truncated lines)."""
    hidden = "alice (console, signed in)\x1b[8m"
    # the escape character is gone, so "[8m" (conceal) is inert text
    assert describe_actor(hidden, "celery", False) == (
        "alice (console, signed in) [8m (claimed, via celery)"
    )
    long = "alice (console, signed in)" + " " * 10 + "x" * 200
    shown = describe_actor(long, "celery", False)
    assert shown.endswith("… (claimed, via celery)") and len(shown) < 100
    assert describe_actor("ana\nbob", "cli", False) == "ana bob (claimed, via CLI)"


def test_an_operator_name_must_be_printable() -> None:
    from charlie.people import ActionRefused, actor_name

    with pytest.raises(ActionRefused, match="printable"):
        actor_name("ana\x1b[8m", None)  # type: ignore[arg-type]
    assert actor_name("  ana  ", None) == "ana"  # type: ignore[arg-type]
