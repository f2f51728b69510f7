"""`charlie worker` as it starts by default: many agents' model calls in flight in one
process, counted by a real HTTP server that answers each after a few seconds (the provider's
own count of concurrent requests, not a timing), and the worker's heartbeat saying so to
`charlie doctor`."""

from __future__ import annotations

from typing import Any

import pytest

import charlie
from charlie import api
from charlie.cli import WORKER_CONCURRENCY
from charlie.config import settings
from charlie.doctor import Check, worker_pools
from charlie.domain import TaskStatus, utcnow
from charlie.presence import POOL_PREFIX, read_pool_detail
from charlie.store.engine import get_engine, read
from charlie.store.heartbeats import load_heartbeats
from tests.conftest import wait_for
from tests.support.cluster import Cluster
from tests.support.fake_openai import FakeOpenAI, ProviderLimit, Recorded, Reply, chat_text

pytestmark = pytest.mark.timeout(300)

MODEL = "openai:fake-model"
TASKS = 24
#: how long the provider takes over each request: long enough that every task's call has
#: arrived before the first is answered, on a loaded machine too
LATENCY = 6.0


def _answer(_: Recorded) -> Reply:
    return Reply(200, chat_text("done").body)


def _pool_beats() -> dict[str, dict[str, Any]]:
    with read(get_engine(settings().database_url)) as conn:
        beats = load_heartbeats(conn)
    found = {}
    for name, beat in beats.items():
        fields = read_pool_detail(beat.detail) if name.startswith(POOL_PREFIX) else None
        if fields is not None:
            found[name.removeprefix(POOL_PREFIX)] = fields
    return found


def test_a_worker_started_as_by_default_holds_many_model_calls_in_flight(
    cluster: Cluster, model_server: FakeOpenAI
) -> None:
    limit = ProviderLimit(latency=LATENCY, answer=_answer)
    model_server.limit = limit
    with cluster.without_workers():
        cluster.start_worker(as_started=True)
        ids = [charlie.submit(f"agent {i}", model=MODEL) for i in range(TASKS)]
        # its heartbeat names its pool, and counts the calls it holds (peak since the beat
        # before: a beat lands while they wait)
        pools = wait_for(
            lambda: [f for f in _pool_beats().values() if int(f["peak"]) >= TASKS // 2],
            timeout=120,
            interval=0.5,
        )
        for task_id in ids:
            info = charlie.wait(task_id, timeout=180)
            assert info.status is TaskStatus.SUCCEEDED, (task_id, info.error)
        with read(get_engine(settings().database_url)) as conn:
            shown = worker_pools(load_heartbeats(conn), utcnow())
        # the console's panel reads the same through the API
        listed = api.worker_pools()
    # One process, one worker: the provider saw most of the tasks' calls at once (prefork's
    # two processes would hold 2).
    assert limit.peak >= TASKS // 2, limit.peak
    assert len(limit.admitted) == TASKS
    assert pools[0]["pool"] == "threads"
    assert pools[0]["concurrency"] == WORKER_CONCURRENCY
    assert pools[0]["counts"] == "model calls"
    # `charlie doctor` shows it
    assert any(
        isinstance(c, Check) and f"threads {WORKER_CONCURRENCY}" in c.detail for c in shown
    ), shown
    # (a worker an earlier module stopped may still count as live by its last heartbeat)
    assert any(
        fields["pool"] == "threads" and fields["concurrency"] == WORKER_CONCURRENCY
        for _node, fields in listed
    ), listed
