"""I12, I13: a wait that settled past its deadline is watched until its outside work ends.

The deadline settles the call and the run goes on without it; the work behind it is not assumed
stopped. The late watch (part of the tool-call sweep) looks at that work again every stall
period, and records its end as the call's one late report; the outcome stands.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import charlie
from charlie import api
from charlie.domain import TaskStatus
from charlie.views import transcript_rows
from tests.conftest import wait_for
from tests.integration.test_loop import assert_every_call_has_one_result
from tests.support.cluster import Cluster
from tests.support.tools import read_ledger

pytestmark = pytest.mark.timeout(120)


def looks(task_id: str) -> list[dict[str, object]]:
    return [e for e in read_ledger() if e["event"] == "wait_for_file.look" and e["task"] == task_id]


def test_a_wait_past_its_deadline_is_watched_to_its_late_report(
    cluster: Cluster, script, tmp_path: Path
) -> None:
    """I13: the wait parks, its two-second deadline settles it, the task finishes; the file
    written afterwards is seen by the late watch and recorded once as a late report (I12)."""
    done_file = tmp_path / "outside-work.done"
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "w", "name": "wait_for_file", "arguments": {"path": str(done_file)}}
                ]
            },
            {"say": "The outside work did not finish in time; reporting that."},
        ]
    )
    task_id = charlie.submit("overdue wait", model=model)
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    call = api.calls(task_id)[0]
    assert call.outcome == "deadline_exceeded" and call.handle == str(done_file)
    assert call.late_reports == 0
    # The watch keeps looking at the work while it runs, with the run already finished.
    before = len(looks(task_id))
    wait_for(lambda: len(looks(task_id)) > before, timeout=30)
    assert all(e["resumed"] for e in looks(task_id)[before:])

    # A look that fails (not an answer about the work) is not its end: the watch goes on.
    flaky = Path(f"{done_file}.flaky")
    flaky.touch()
    before = len(looks(task_id))
    wait_for(lambda: len(looks(task_id)) >= before + 2, timeout=30)
    assert api.calls(task_id)[0].late_reports == 0
    flaky.unlink()

    done_file.write_text("finished after the deadline")
    wait_for(lambda: api.calls(task_id)[0].late_reports == 1, timeout=30)
    call = api.calls(task_id)[0]
    assert call.late_result == {"outcome": "ok", "result": "finished after the deadline"}
    assert call.outcome == "deadline_exceeded"  # the first outcome stands (I12)
    transcript = charlie.transcript(task_id)
    result = next(i for i in transcript if i.kind == "tool_result")
    assert result.outcome == "deadline_exceeded"
    assert_every_call_has_one_result(task_id)
    # Charlie's own view shows the outcome and, beside it, what came after.
    row = next(line for _, line in transcript_rows(task_id) if "wait_for_file" in line)
    assert "[deadline_exceeded" in row and "late report: ok" in row, row

    # Once its end is recorded the watch stops looking: the sweep rounds of two stall periods
    # went by (the watch looked once a stall period above), no new look.
    seen = len(looks(task_id))
    stall = float(cluster.env["CHARLIE_STALL_SECONDS"])
    cluster.sweep_rounds(int(2 * stall / float(cluster.env["CHARLIE_SWEEP_INTERVAL"])) + 2)
    assert len(looks(task_id)) == seen
    assert api.calls(task_id)[0].late_reports == 1
