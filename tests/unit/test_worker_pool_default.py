"""`charlie worker`'s pool when its command line names none: threads, many model calls in
flight per process (docs/production/workers.md); a pool or concurrency given is kept."""

from __future__ import annotations

import pytest

from charlie.cli import WORKER_CONCURRENCY, WORKER_POOL, worker_pool_argv
from charlie.doctor import worker_pools
from charlie.domain import utcnow
from charlie.presence import POOL_PREFIX, pool_detail, read_pool_detail
from charlie.store.heartbeats import WORKER_PREFIX, Heartbeat

pytestmark = pytest.mark.backend_free


def test_the_default_is_a_threads_pool_of_many() -> None:
    assert WORKER_POOL == "threads"
    assert 32 <= WORKER_CONCURRENCY <= 128
    assert worker_pool_argv([]) == ["--pool", "threads", "--concurrency", str(WORKER_CONCURRENCY)]
    assert worker_pool_argv(["-E", "-n", "w1@%h"]) == worker_pool_argv([])


@pytest.mark.parametrize(
    ("args", "added"),
    [
        (["--pool", "prefork"], ["--concurrency", "2"]),
        (["-P", "prefork", "-c", "4"], []),
        (["--pool=solo"], ["--concurrency", "2"]),
        (["-Pthreads"], ["--concurrency", str(WORKER_CONCURRENCY)]),
        (["--pool", "gevent", "--concurrency=500"], []),
        (["-c", "8"], ["--pool", "threads"]),
        (["--concurrency", "300"], ["--pool", "threads"]),
    ],
)
def test_a_pool_or_concurrency_given_is_kept(args: list[str], added: list[str]) -> None:
    assert worker_pool_argv(args) == added


def test_doctor_shows_each_live_workers_pool_and_calls_in_flight() -> None:
    now = utcnow()
    beats = {
        WORKER_PREFIX + "w1@a": Heartbeat(WORKER_PREFIX + "w1@a", now, "w1@a", "charlie"),
        POOL_PREFIX + "w1@a": Heartbeat(
            POOL_PREFIX + "w1@a", now, "w1@a", pool_detail("threads", 64, 12, 40, "model calls")
        ),
        # a pool heartbeat left by a worker no longer alive is not shown
        POOL_PREFIX + "gone@b": Heartbeat(
            POOL_PREFIX + "gone@b", now, "gone@b", pool_detail("prefork", 2, 2, 2, "tasks")
        ),
    }
    shown = worker_pools(beats, now)
    assert [c.detail for c in shown] == [
        "w1@a: threads 64: 12 model calls in flight (at most 40 since the beat before)"
    ]
    assert read_pool_detail("charlie,celery") is None
