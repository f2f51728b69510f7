"""`charlie doctor` warns that anyone on a shared, unsigned broker can act as an operator
(I32): a doctor run of its own (a fresh home), whatever the session's backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_production_path import doctor, fresh_env

pytestmark = pytest.mark.backend_free


def test_doctor_warns_that_anyone_on_a_shared_unsigned_broker_can_act(tmp_path: Path) -> None:
    """Actions by Celery message on and messages unsigned (both the defaults) on a broker off
    this machine's loopback: any client of it can approve a held call. Doctor says so (a WARN:
    the exit status is not changed by it) and names the two fixes (when it does not warn:
    tests/unit/test_provider_waits.py)."""
    shared = "redis://192.0.2.1:6379/0"  # TEST-NET: nothing answers, the broker check fails
    _, checks = doctor(fresh_env(tmp_path, CHARLIE_BROKER_URL=shared))
    warning = checks["operator actions"]
    assert warning["status"] == "WARN", warning
    assert "CHARLIE_CELERY_OPERATOR_ACTIONS=0" in warning["fix"] and "sign" in warning["fix"]
