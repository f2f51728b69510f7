"""A missing part skips locally and fails in CI (CI=true): a green CI run cannot hide whole
suites skipped for a missing Chromium, chromedriver or bubblewrap."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cluster import REPO

PROBE = """
from tests.support.needs import need

def test_needs_a_missing_part():
    need("chromedriver is missing (apt-get install chromium-driver)", "no browser")
"""


def _run_probe(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = str(REPO)
    # -p no:... and a rootdir of its own: the probe runs without this suite's conftest (which
    # would start a cluster), importing only tests.support.needs.
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(tmp_path), str(probe)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_missing_part_skips_locally_and_says_why(tmp_path: Path) -> None:
    done = _run_probe(tmp_path, ci=None)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 skipped" in done.stdout


@pytest.mark.parametrize("ci", ["true", "1"])
def test_a_missing_part_fails_in_ci(tmp_path: Path, ci: str) -> None:
    done = _run_probe(tmp_path, ci=ci)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed" in done.stdout
    assert "chromedriver is missing" in done.stdout
    assert "a missing part is a failure, not a skip" in done.stdout
