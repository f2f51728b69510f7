"""Workers on other hosts: a worker cut off from the database and the broker for longer than a
lease, while it works, is fenced when its late writes arrive, and rejoins when the link is back.

Each worker runs in a network namespace of its own (tests/support/hosts.py), joined to this
machine by a veth pair; it reaches PostgreSQL and the broker (Redis or RabbitMQ) at this side's
address of its pair, not over loopback. The partition takes that link down: the worker's
packets are dropped without a word, its connections stay open and its statements hang, as on a
pulled cable, and when the link comes back what it sent gets through, late (I5, I12, I3).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import charlie
from charlie import api
from charlie.domain import TaskStatus
from tests.conftest import BACKEND, model_calls, wait_for
from tests.integration.test_loop import assert_every_call_has_one_result
from tests.support.cluster import Cluster
from tests.support.hosts import Forwarder, Host, endpoint, hosts, moved, netns_problem
from tests.support.needs import need
from tests.support.tools import read_ledger

pytestmark = [pytest.mark.recovery, pytest.mark.timeout(240)]


def _default_port(url: str) -> int:
    return 5432 if url.startswith("postgresql") else 6379 if url.startswith("redis") else 5672


@pytest.fixture
def far_hosts() -> Iterator[dict[str, tuple[Host, dict[str, str]]]]:
    """Two other hosts, ``a`` and ``b``, and the settings their workers reach the session's
    database and broker with: this machine's address on their link, through a forwarder."""
    if BACKEND.database_url is None or BACKEND.broker_url is None:
        pytest.skip(
            "workers on other hosts reach a database server and a broker over the network "
            "(CHARLIE_TEST_DATABASE_URL, CHARLIE_TEST_BROKER_URL); SQLite and the embedded "
            "broker are files on one machine"
        )
    need(netns_problem(), "workers on other hosts (network namespaces)")
    forwarders: list[Forwarder] = []
    try:
        with hosts(2) as made:
            found: dict[str, tuple[Host, dict[str, str]]] = {}
            for name, host in zip("ab", made, strict=True):
                env = {}
                for key, url in (
                    ("CHARLIE_DATABASE_URL", BACKEND.database_url),
                    ("CHARLIE_BROKER_URL", BACKEND.broker_url),
                ):
                    target = endpoint(url, _default_port(url))
                    forwarder = Forwarder((host.here, 0), target).start()
                    forwarders.append(forwarder)
                    env[key] = moved(url, host.here, forwarder.port)
                found[name] = (host, env)
            # the setup reaches: a namespace sees this side's forwarder, and nothing on loopback
            host, env = found["a"]
            probe = (
                "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 5)"
            )
            port = env["CHARLIE_DATABASE_URL"].rsplit(":", 1)[1].split("/")[0]
            subprocess.run(
                [*host.command(), "python3", "-c", probe, host.here, port], check=True, timeout=20
            )
            yield found
            for host, _ in found.values():
                host.heal()  # (the workers stop before the links go)
    finally:
        for forwarder in forwarders:
            forwarder.close()


def _group(cluster: Cluster, worker: subprocess.Popen[bytes]) -> set[int]:
    return set(cluster.worker_processes().get(worker.pid, []))


def _writes(key: str) -> list[dict[str, object]]:
    return [e for e in read_ledger() if e.get("event") == "write" and e.get("key") == key]


def test_a_partitioned_worker_is_fenced_and_its_runs_go_on_elsewhere(
    cluster: Cluster, script, far_hosts: dict[str, tuple[Host, dict[str, str]]], tmp_path: Path
) -> None:
    """A worker on another host, cut off for longer than a lease in the middle of a model call
    and of a write tool: the other host's worker takes both runs over; when the link comes
    back, the cut-off worker's work ends and its late writes change nothing (the model's turn
    is written once, by the worker that holds the run; the call keeps its one outcome and
    counts the late report; the write is never done twice: I3, I5, I10, I12), and it goes on
    working, the same process."""
    (host_a, env_a), (host_b, env_b) = far_hosts["a"], far_hosts["b"]
    # the cut-off worker's model call and write end when this file exists: after the link is
    # back, so their writes arrive late, not during the partition (where they fail)
    healed = tmp_path / "healed"
    thinker, thinker_ledger = script([{"say": "thought it over", "until": str(healed)}])
    writer, _ = script(
        [
            {
                "tool_calls": [
                    {
                        "id": "w",
                        "name": "ledger_write",
                        "arguments": {"key": "k-far", "until": str(healed)},
                    }
                ]
            },
            {"say": "checked the write"},
        ]
    )
    with cluster.without_workers():
        worker_a = cluster.start_worker(concurrency=3, prefix=host_a.command(), env=env_a)
        thinking = charlie.submit("think on host a", model=thinker)
        writing = charlie.submit("write on host a", model=writer)
        # both at work on host a: its model call and its write tool
        wait_for(lambda: model_calls(thinker_ledger), timeout=90)
        wait_for(lambda: _writes("k-far"), timeout=90)
        group_a = _group(cluster, worker_a)
        assert model_calls(thinker_ledger)[0]["pid"] in group_a
        assert _writes("k-far")[0]["pid"] in group_a

        host_a.partition()
        cut = time.monotonic()
        worker_b = cluster.start_worker(concurrency=3, prefix=host_b.command(), env=env_b)
        # host b takes both runs over while host a is cut off: the write's run to its end (the
        # call settled without its worker), the model's turn to a model call of its own
        info = charlie.wait(writing, timeout=120)
        assert info.status is TaskStatus.SUCCEEDED, info.error
        (call,) = api.calls(writing)
        assert call.outcome == "interrupted", call  # started on a, never run again (I10)
        assert call.late_reports == 0
        wait_for(lambda: len(model_calls(thinker_ledger)) == 2, timeout=60)
        group_b = _group(cluster, worker_b)
        assert model_calls(thinker_ledger)[1]["pid"] in group_b
        assert time.monotonic() - cut > cluster_lease_seconds()

        host_a.heal()
        healed.write_text("")
        late_fenced = True
        info = charlie.wait(thinking, timeout=60)
        assert info.status is TaskStatus.SUCCEEDED, info.error
        # a's write ends now and its result arrives late: a late report, not a second outcome.
        # (Unless a's worker saw its broker connection drop during the partition, as it does
        # on RabbitMQ, whose heartbeats fail: Celery then stops the late-acknowledged tasks it
        # was running (worker_cancel_long_running_tasks_on_connection_loss), and the write's
        # process is gone, as if killed: nothing arrives late.)
        handler = int(str(_writes("k-far")[0]["pid"]))
        wait_for(lambda: _held_ends("k-far") or not _alive(handler), timeout=60)
        if _held_ends("k-far"):
            wait_for(lambda: api.calls(writing)[0].late_reports == 1, timeout=60)
        else:
            late_fenced = False
        (call,) = api.calls(writing)
        assert call.outcome == "interrupted"
        assert call.late_reports == (1 if late_fenced else 0)
        assert len(_writes("k-far")) == 1  # never written twice
        # ...and the model's turn is b's: one answer, moved by b; a's commit was refused
        assert len(_answers(thinking)) == 1
        movers = {t["worker"] for t in api.history(thinking) if t["from_phase"] == "call_model"}
        assert [int(w.rsplit(":", 1)[1]) in group_b for w in movers] == [True], movers
        thought = charlie.get_task(thinking)
        # one response recorded (b's), after a repeat (a's call, never recorded: I3)
        assert (thought.model_calls, thought.model_repeats) == (1, 1)

        # host a rejoins: with b gone, a (the same process) runs new work to its end
        cluster.kill(worker_b)
        rejoined, _ = script(
            [
                {
                    "tool_calls": [
                        {"id": "w", "name": "ledger_write", "arguments": {"key": "k-back"}}
                    ]
                },
                {"say": "back"},
            ]
        )
        after = charlie.submit("on host a again", model=rejoined)
        info = charlie.wait(after, timeout=90)
        assert info.status is TaskStatus.SUCCEEDED, info.error
        assert [w["pid"] in _group(cluster, worker_a) for w in _writes("k-back")] == [True]
        assert worker_a.poll() is None
        for task_id in (thinking, writing, after):
            assert_every_call_has_one_result(task_id)


def _held_ends(key: str) -> list[dict[str, object]]:
    return [e for e in read_ledger() if e.get("event") == "write.held_end" and e.get("key") == key]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def _answers(task_id: str) -> list[object]:
    return [i.payload for i in charlie.transcript(task_id) if i.kind == "final"]


def cluster_lease_seconds() -> float:
    from charlie.config import settings

    return settings().lease_seconds
