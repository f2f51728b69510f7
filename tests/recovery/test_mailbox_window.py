"""I22 at a boundary whose claim committed on its own (a redelivered or sweep-republished tick):
a message sent after that claim and before the boundary's transaction is taken in there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.cluster import REPO


@pytest.mark.parametrize("claim", ["plain", "durable"])
def test_a_message_sent_just_before_a_boundary_enters_there(claim: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.mailbox_window", claim],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    items = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    kinds = [(i["turn"], i["kind"], i["message_id"]) for i in items]
    # After turn 0's result, before turn 1's model items; no extra turn for it.
    assert kinds[2:] == [
        (0, "tool_call", None),
        (0, "tool_result", None),
        (0, "input", "m1"),
        (1, "final", None),
    ], kinds
