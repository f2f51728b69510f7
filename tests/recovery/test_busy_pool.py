"""Recovery does not wait for a free slot in a busy pool (I4).

With every worker process busy in a long tool handler, a run whose tick was lost is still found
and re-published by the beat within the stall period: the sweeps run in `charlie beat`'s own
process, not as tasks queued behind the handlers."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
from sqlalchemy import select

import charlie
from charlie.domain import TaskStatus, execution_id_for
from charlie.runtime import get_runtime
from charlie.store.engine import read
from charlie.store.schema import executions
from tests.conftest import wait_for
from tests.recovery.test_kills import read_ledger_for
from tests.support.cluster import REPO, Cluster

pytestmark = [pytest.mark.recovery, pytest.mark.timeout(240)]

#: 2 workers of 2 processes each (the cluster's shape)
SLOTS = 4
#: long enough that the lost run is found well before any handler ends
BUSY_SECONDS = 30


def _swept(task_id: str) -> bool:
    with read(get_runtime().engine) as conn:
        row = conn.execute(
            select(executions.c.swept_at).where(executions.c.id == execution_id_for(task_id))
        ).first()
    return row is not None and row.swept_at is not None


def test_a_lost_tick_is_found_while_every_pool_slot_is_busy(cluster: Cluster, script) -> None:
    cluster.ensure(workers=2)
    busy, _ = script(
        [
            {
                "tool_calls": [
                    {
                        "id": "s",
                        "name": "sleep_then",
                        "arguments": {"seconds": BUSY_SECONDS, "value": "busy"},
                    }
                ]
            },
            {"say": "rested"},
        ]
    )
    sleepers = [charlie.submit("busy", model=busy) for _ in range(SLOTS)]
    wait_for(lambda: all(read_ledger_for(t, "sleep_then.start") for t in sleepers), timeout=60)
    # A task whose first tick was never published (its producer's broker was down).
    lost = f"lost-{uuid.uuid4().hex[:8]}"
    model, _ = script([{"say": "found"}])
    env = {**os.environ, "CHARLIE_BROKER_URL": "redis://127.0.0.1:1/0"}
    code = f"import charlie; charlie.submit('lost', model={model!r}, task_id={lost!r})"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    # Found and re-published while every handler still runs.
    wait_for(lambda: _swept(lost), timeout=BUSY_SECONDS / 2)
    assert not any(read_ledger_for(t, "sleep_then.end") for t in sleepers), (
        "the sweep only acted once a slot was free"
    )
    # and it runs as soon as a slot frees
    info = charlie.wait(lost, timeout=BUSY_SECONDS + 60)
    assert info.status is TaskStatus.SUCCEEDED
    assert info.result["answer"] == "found"
    for t in sleepers:
        assert charlie.wait(t, timeout=60).status is TaskStatus.SUCCEEDED
