"""What a test needs from the machine, and what a missing part means.

Locally a missing part (bubblewrap, Chromium and chromedriver, a database or broker) skips the
tests that need it and says why. In CI (``CI=true``) it is a failure: a green run must never hide
whole suites that did not run because an install step went missing.
"""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    """Whether this run is CI's (``CI`` set to a true value, as CI services and .ci/run do)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def need(problem: str | None, what: str) -> None:
    """Skip the calling test (or fixture) when ``problem`` is set; fail it in CI."""
    if problem is None:
        return
    message = f"{what}: {problem}"
    if in_ci():
        pytest.fail(f"{message} (CI=true: a missing part is a failure, not a skip)", pytrace=False)
    pytest.skip(message)
