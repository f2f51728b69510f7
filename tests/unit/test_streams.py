"""The event stream's transports (charlie/streams): offsets, resuming, bounded and expiring
logs, and a sink that never breaks the run it reports on (I28)."""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from charlie.config import Settings
from charlie.streams.base import StreamEvent
from charlie.streams.files import FileTransport
from charlie.streams.sink import TaskEvents

REDIS = os.environ.get("CHARLIE_TEST_STREAM_REDIS", "redis://127.0.0.1:6379/11")


def events(n: int, kind: str = "text", start: int = 0) -> list[dict[str, Any]]:
    return [{"type": kind, "task_id": "t", "text": f"piece {i}"} for i in range(start, start + n)]


def texts(got: list[StreamEvent]) -> list[str]:
    return [str(e.data.get("text")) for e in got]


def test_file_offsets_resume_and_a_late_reader_gets_everything(tmp_path: Path) -> None:
    files = FileTransport(tmp_path / "streams", ttl=60, max_events=1000)
    files.append("task-a", events(3))
    files.append("task-b", events(1, start=100))  # another task's log is another file
    files.append("task-a", events(2, start=3))
    everything = files.read("task-a", None, 0)
    assert texts(everything) == [f"piece {i}" for i in range(5)]
    rest = files.read("task-a", everything[1].offset, 0)
    assert texts(rest) == [f"piece {i}" for i in range(2, 5)]
    assert files.read("task-a", everything[-1].offset, 0) == []
    assert texts(files.read("task-b", None, 0)) == ["piece 100"]
    assert files.read("nobody", None, 0.1) == []
    with pytest.raises(ValueError, match="byte position"):
        files.read("task-a", "1-0", 0)
    assert (tmp_path / "streams").stat().st_mode & 0o077 == 0


def test_a_file_follower_wakes_for_what_another_writer_appends(tmp_path: Path) -> None:
    files = FileTransport(tmp_path, ttl=60, max_events=1000)
    timer = threading.Timer(0.2, files.append, ("t", events(1)))
    timer.start()
    got = files.read("t", None, 30)
    timer.join()
    assert texts(got) == ["piece 0"]


def test_a_torn_last_line_is_not_read_until_it_is_whole(tmp_path: Path) -> None:
    files = FileTransport(tmp_path, ttl=60, max_events=1000)
    files.append("t", events(1))
    with open(files.path("t"), "ab") as f:
        f.write(b'{"type":"text","te')  # a writer killed mid-line
    assert texts(files.read("t", None, 0)) == ["piece 0"]


def test_a_full_file_drops_deltas_keeps_the_rest_and_says_so_once(tmp_path: Path) -> None:
    files = FileTransport(tmp_path, ttl=60, max_events=100)  # about 51 kB
    for n in range(200):
        files.append("t", events(10, start=n * 10))
    files.append("t", [{"type": "model_end", "task_id": "t", "status": "completed"}])
    files.append("t", [{"type": "end", "task_id": "t"}])
    assert files.path("t").stat().st_size <= files.max_bytes * 5 // 4
    got = files.read("t", None, 0)
    kinds = [e.type for e in got]
    assert kinds.count("truncated") == 1
    assert kinds[-2:] == ["model_end", "end"]


def test_files_nobody_wrote_to_for_the_ttl_are_removed(tmp_path: Path) -> None:
    files = FileTransport(tmp_path, ttl=60, max_events=100)
    files.append("old", events(1))
    files.append("fresh", events(1))
    past = time.time() - 120
    os.utime(files.path("old"), (past, past))
    files._swept = 0.0  # the next append sweeps (else at most once a minute)
    files.append("fresh", events(1))
    assert not files.path("old").exists() and files.path("fresh").exists()


def test_a_failing_transport_never_raises_into_the_run_and_is_left_alone_a_while() -> None:
    class Broken:
        name = "broken"
        calls = 0

        def append(self, task_id: str, batch: list[dict[str, Any]]) -> None:
            Broken.calls += 1
            raise ConnectionError("down")

        def read(self, task_id: str, after: str | None, block: float) -> list[StreamEvent]:
            return []

        def close(self) -> None:
            pass

    sink = TaskEvents(Broken())
    sink.emit("t", "text", text="a")
    stream = sink.model_stream("t", 0, "0.1.1")
    stream.text("b")
    stream.end("completed")
    assert sink.flush()
    assert Broken.calls == 1  # one failure, then a pause instead of a timeout per delta


def _settings(tmp_path: Path, broker: str, **more: Any) -> Settings:
    base = Settings(home=tmp_path, database_url="sqlite://", broker_url=broker)
    return replace(base, **more)


def test_where_the_events_go(tmp_path: Path) -> None:
    assert _settings(tmp_path, "charliefs://").stream_target == f"file://{tmp_path / 'streams'}"
    assert _settings(tmp_path, "redis://h:6379/2").stream_target == "redis://h:6379/2"
    # RabbitMQ: its stream queue; SQS cannot carry it: none, unless a Redis is named for it
    assert _settings(tmp_path, "amqp://guest@h//").stream_target == "amqp://guest@h//"
    assert _settings(tmp_path, "sqs://k:s@").stream_target is None
    named = _settings(tmp_path, "sqs://k:s@", stream_url="redis://s:6379/0")
    assert named.stream_target == "redis://s:6379/0"
    assert _settings(tmp_path, "charliefs://", streaming=False).stream_target is None


def test_a_deployment_whose_broker_cannot_carry_it_is_told_what_to_set(tmp_path: Path) -> None:
    from charlie.api import _why_no_stream

    class Rt:
        settings = _settings(tmp_path, "sqs://k:s@")

    why = _why_no_stream(Rt())  # type: ignore[arg-type]
    assert "sqs broker cannot carry" in why and "CHARLIE_STREAM_URL" in why


@pytest.fixture
def redis_transport() -> Any:
    import redis

    from charlie.streams.redis_stream import RedisTransport

    try:
        redis.Redis.from_url(REDIS, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {REDIS}: {exc}")
    transport = RedisTransport(REDIS, ttl=30, max_events=100)
    yield transport
    transport.close()


def test_redis_streams_resume_and_are_bounded_and_expiring(redis_transport: Any) -> None:
    task = f"t-{uuid.uuid4().hex}"
    redis_transport.append(task, events(3))
    got = redis_transport.read(task, None, 0)
    assert texts(got) == ["piece 0", "piece 1", "piece 2"]
    assert texts(redis_transport.read(task, got[0].offset, 0)) == ["piece 1", "piece 2"]
    for n in range(30):
        redis_transport.append(task, events(100, start=n * 100))
    client = redis_transport._client
    key = redis_transport.key(task)
    assert client.xlen(key) < 300  # MAXLEN ~ 100 (whole nodes of ~100 are dropped)
    assert 0 < client.ttl(key) <= 30
    with pytest.raises(ValueError, match="entry id"):
        redis_transport.read(task, "not-an-id", 0)
    client.delete(key)


def test_a_redis_follower_wakes_for_what_another_writer_appends(redis_transport: Any) -> None:
    task = f"t-{uuid.uuid4().hex}"
    timer = threading.Timer(0.2, redis_transport.append, (task, events(1)))
    timer.start()
    got = redis_transport.read(task, None, 10)
    timer.join()
    assert texts(got) == ["piece 0"]
    redis_transport._client.delete(redis_transport.key(task))


RABBIT = os.environ.get("CHARLIE_TEST_STREAM_AMQP", "amqp://guest:guest@127.0.0.1:5672//")


@pytest.fixture
def rabbit_transport() -> Any:
    from kombu import Connection

    from charlie.streams.rabbitmq_stream import RabbitStreamTransport

    try:
        with Connection(RABBIT, connect_timeout=2) as connection:
            connection.connect()
    except Exception as exc:
        pytest.skip(f"no RabbitMQ at {RABBIT}: {exc}")
    queue = f"charlie.events.test-{uuid.uuid4().hex[:8]}"
    transport = RabbitStreamTransport(RABBIT, ttl=60, max_events=100, queue=queue)
    yield transport
    transport.close()
    with Connection(RABBIT) as connection:
        connection.default_channel.queue_delete(queue)


def test_a_rabbitmq_stream_keeps_each_task_apart_and_resumes(rabbit_transport: Any) -> None:
    rabbit_transport.append("a", events(3))
    rabbit_transport.append("b", events(2, start=10))
    rabbit_transport.append("a", events(1, start=3))
    got = rabbit_transport.read("a", None, 5)
    assert texts(got) == ["piece 0", "piece 1", "piece 2", "piece 3"]
    assert texts(rabbit_transport.read("a", got[1].offset, 0)) == ["piece 2", "piece 3"]
    assert texts(rabbit_transport.read("b", None, 5)) == ["piece 10", "piece 11"]
    assert rabbit_transport.read("a", got[-1].offset, 0.2) == []
    with pytest.raises(ValueError, match="a number"):
        rabbit_transport.read("a", "1-0", 0)


def test_a_rabbitmq_follower_wakes_for_what_another_writer_appends(rabbit_transport: Any) -> None:
    rabbit_transport.append("other", events(1))
    timer = threading.Timer(0.3, rabbit_transport.append, ("t", events(1, start=7)))
    timer.start()
    got = rabbit_transport.read("t", None, 10)
    timer.join()
    assert texts(got) == ["piece 7"]


def test_a_rabbitmq_stream_declared_with_other_bounds_is_used_as_it_is(
    rabbit_transport: Any,
) -> None:
    """A worker whose CHARLIE_STREAM_TTL / CHARLIE_STREAM_MAX_EVENTS differ from those the
    queue was declared with (an operator's change, a release's, a second deployment on the
    vhost) still writes and reads the stream, and `charlie doctor` is told what differs."""
    from charlie.streams import rabbitmq_stream

    queue = rabbit_transport.queue
    rabbit_transport.append("a", events(1))
    other = rabbitmq_stream.RabbitStreamTransport(RABBIT, ttl=120, max_events=500, queue=queue)
    try:
        other.append("a", events(1, start=1))
        assert texts(other.read("a", None, 5)) == ["piece 0", "piece 1"]
        assert texts(rabbit_transport.read("a", None, 5)) == ["piece 0", "piece 1"]
        assert other.differs is not None and "PRECONDITION_FAILED" in other.differs
        bounds_differ = rabbitmq_stream.bounds_differ
        said = bounds_differ(RABBIT, ttl=120, max_events=500, queue=queue)
        assert said is not None and "x-max-" in said
        assert bounds_differ(RABBIT, ttl=60, max_events=100, queue=queue) is None
    finally:
        other.close()
    assert bounds_differ(RABBIT, ttl=60, max_events=100, queue=f"{queue}.x") is None
