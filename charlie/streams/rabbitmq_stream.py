"""A RabbitMQ stream queue: the transport when the broker is RabbitMQ (3.9 or later).

One stream queue (``charlie.events``) holds every task's events, each message carrying its
task in a header; RabbitMQ bounds it (``x-max-length-bytes``) and drops what is older than the
ttl (``x-max-age``), a segment at a time. The offset is the stream's own (``x-stream-offset``);
a reader consumes from there over AMQP 0.9.1 (``x-stream-offset`` on ``basic.consume``) and
keeps its task's events. So one task's reader reads past every other task's events of the
retention window: fine for a few hundred busy tasks, and where that is too many,
``CHARLIE_STREAM_URL=redis://...`` keeps a log per task.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import amqp
from kombu.connection import Connection as _Connection

from charlie.streams.base import StreamEvent, StreamUnavailable, decode, encode

#: kombu's Connection, untyped
Connection: Any = _Connection

QUEUE = "charlie.events"
#: the stream's size bound, per event a task may keep (it holds every task's)
BYTES_PER_EVENT = 512
TASKS_KEPT = 100
SEGMENT_BYTES = 8 * 1024 * 1024
PREFETCH = 1000
#: a read that found something stops once the stream is quiet this long
QUIET_SECONDS = 0.05
#: how long a read waits for the first chunk of what the stream already holds past its start
#: (a loaded broker can take longer than QUIET_SECONDS to begin delivering)
FIRST_CHUNK_SECONDS = 2.0


class RabbitStreamTransport:
    name = "rabbitmq"

    def __init__(self, url: str, *, ttl: float, max_events: int, queue: str = QUEUE) -> None:
        self.url = url
        self.queue = queue
        self.arguments = {
            "x-queue-type": "stream",
            "x-max-age": f"{max(1, int(ttl))}s",
            "x-max-length-bytes": max_events * BYTES_PER_EVENT * TASKS_KEPT,
            "x-stream-max-segment-size-bytes": SEGMENT_BYTES,
        }
        self._lock = threading.Lock()
        self._writer: Any = None
        self._channel_open: Any = None
        #: what the broker said when the queue exists with other bounds (None: the same, or
        #: not declared yet): the queue is used as it is (see declare)
        self.differs: str | None = None
        #: (task, after) -> the last offset read past for it, so a follower does not read the
        #: other tasks' events again on every read
        self._scanned: dict[tuple[str, str | None], int] = {}

    def _channel(self) -> Any:
        if self._writer is None:
            connection = Connection(self.url, connect_timeout=5)
            connection.connect()
            self._writer = connection
        if self._channel_open is None:
            self._channel_open, _ = self.declare(self._writer)
        return self._channel_open

    def declare(self, connection: Any) -> tuple[Any, Any]:
        """A channel on ``connection`` and the queue's declare-ok. A queue declared already
        with other bounds (``x-max-age``, ``x-max-length-bytes``: another deployment's, or one
        from before an operator or a release changed CHARLIE_STREAM_TTL or
        CHARLIE_STREAM_MAX_EVENTS) is used as it is, its bounds the broker's (a RabbitMQ policy
        changes them on a running fleet); ``differs`` keeps what the broker said, for
        `charlie doctor`. Refusing it would drop every event (PRECONDITION_FAILED on every
        declare)."""
        channel = connection.channel()
        try:
            declared = channel.queue_declare(
                self.queue, durable=True, auto_delete=False, arguments=self.arguments
            )
            self.differs = None
            return channel, declared
        except amqp.exceptions.PreconditionFailed as exc:
            self.differs = str(exc)
        channel = connection.channel()  # the broker closed the one it refused
        return channel, channel.queue_declare(self.queue, passive=True)

    def append(self, task_id: str, events: list[dict[str, Any]]) -> None:
        with self._lock:
            try:
                channel = self._channel()
                for event in events:
                    message = amqp.Message(
                        encode(event),
                        content_type="application/json",
                        application_headers={"task": task_id},
                        delivery_mode=2,
                    )
                    channel.basic_publish(message, exchange="", routing_key=self.queue)
            except Exception:
                self._reset()
                raise

    def _reset(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):  # already gone
                self._writer.release()
        self._writer = None
        self._channel_open = None

    def read(self, task_id: str, after: str | None, block: float) -> list[StreamEvent]:
        if after is not None and not after.isdigit():
            raise ValueError(f"{after!r} is not an offset of a RabbitMQ stream (a number)")
        scanned = self._scanned.get((task_id, after))
        start: int | str = (
            scanned + 1 if scanned is not None else int(after) + 1 if after is not None else "first"
        )
        found: list[StreamEvent] = []
        last = [scanned]

        def take(message: Any) -> None:
            headers = message.headers or {}
            offset = headers.get("x-stream-offset")
            message.channel.basic_ack(message.delivery_tag)
            # a stream is delivered a chunk at a time: the chunk may begin before ``start``
            if not isinstance(offset, int) or (isinstance(start, int) and offset < start):
                return
            last[0] = offset
            if headers.get("task") == task_id:
                data = decode(message.body)
                if data is not None:
                    found.append(StreamEvent(str(offset), data))

        try:
            with Connection(self.url, connect_timeout=5) as connection:
                channel, declared = self.declare(connection)
                # The stream's end when this read began, read as its message count: exact while
                # its offsets begin at 0 (nothing dropped yet by its bounds). What it holds past
                # ``start`` is waited for, not taken for absent because the broker was slow to
                # send its first chunk: a read of "what is there now" (block 0) must not come
                # back empty for that. Once it has been read past, quiet ends the read.
                held = int(getattr(declared, "message_count", 0) or 0)
                expected = held - 1 if held > (start if isinstance(start, int) else 0) else None
                channel.basic_qos(0, PREFETCH, False)
                channel.basic_consume(
                    self.queue, callback=take, arguments={"x-stream-offset": start}
                )
                began = time.monotonic()
                deadline = began + block
                while True:
                    try:
                        connection.drain_events(timeout=QUIET_SECONDS)
                        continue  # more may be right behind
                    except TimeoutError:
                        pass
                    ended = found or time.monotonic() >= deadline
                    if ended and _read_past(last[0], expected, began):
                        break
        except (OSError, amqp.exceptions.AMQPError) as exc:
            raise StreamUnavailable(f"the event stream could not be read: {exc}") from exc
        if last[0] is not None and not found:
            if len(self._scanned) > 10000:
                self._scanned.clear()
            self._scanned[(task_id, after)] = last[0]
        return found

    def close(self) -> None:
        with self._lock:
            self._reset()


def _read_past(last: int | None, expected: int | None, began: float) -> bool:
    """Whether a read has reached what the stream held when it began (``expected``: its last
    offset then, None when nothing was there past the read's start), or waited long enough."""
    if expected is None or (last is not None and last >= expected):
        return True
    return time.monotonic() - began >= FIRST_CHUNK_SECONDS


def bounds_differ(url: str, *, ttl: float, max_events: int, queue: str = QUEUE) -> str | None:
    """What differs between the event stream queue as the broker holds it and the bounds this
    process's settings give it (the broker's PRECONDITION_FAILED text, naming the argument and
    both values), or None: the same, or no such queue yet. Declares nothing new: the queue is
    looked up first, and a declare of an equivalent queue changes nothing."""
    transport = RabbitStreamTransport(url, ttl=ttl, max_events=max_events, queue=queue)
    with Connection(url, connect_timeout=5) as connection:
        try:
            connection.channel().queue_declare(queue, passive=True)
        except amqp.exceptions.NotFound:
            return None
        transport.declare(connection)
    return transport.differs
