"""An append-only file per task: the embedded default's transport (one machine).

``DIR/<sha256 of the task id>.jsonl``, one JSON event a line; the offset is the byte position
after an event. Every process on the machine appends with ``O_APPEND`` under an exclusive
``flock`` (a worker killed mid-write leaves at most a torn last line, which readers skip), and
readers follow by polling the file's size. Bounded: past ``max_events`` x 512 bytes a task's
deltas are dropped (a ``truncated`` event says so once) and only the other events are kept, up
to a quarter more. Expiring: any writer removes, at most once a minute, the files nobody has
written to for ``ttl`` seconds.

Every line is bounded too (``MAX_EVENT_BYTES``): an event that would be longer is split where it
lists what can grow (a ``waiting`` event holding hundreds of calls becomes several, each with its
``part`` and ``parts``) or has its longest texts cut (``clipped``); and a reader takes a line of
any length (one an older writer left), so no line stalls every reader of a task for good.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
from pathlib import Path
from typing import Any

from charlie.home import PRIVATE_FILE, private_dir
from charlie.streams.base import StreamEvent, bound_event, decode, encode

#: the event types dropped first when a task's file is full
DELTAS = frozenset({"text", "reasoning", "tool_args"})
BYTES_PER_EVENT = 512
READ_CHUNK = 1 << 20
#: the longest line an event is written as (a pad's lines too)
MAX_EVENT_BYTES = 64 * 1024
POLL_SECONDS = 0.05
SWEEP_EVERY = 60.0


class FileTransport:
    name = "file"

    def __init__(self, directory: Path, *, ttl: float, max_events: int) -> None:
        self.directory = directory
        self.ttl = ttl
        self.max_bytes = max_events * BYTES_PER_EVENT
        self._swept = 0.0
        self._ready = False

    def path(self, task_id: str) -> Path:
        digest = hashlib.sha256(task_id.encode("utf-8", "surrogatepass")).hexdigest()[:40]
        return self.directory / f"{digest}.jsonl"

    def append(self, task_id: str, events: list[dict[str, Any]]) -> None:
        if not self._ready:
            private_dir(self.directory)
            self._ready = True
        self._sweep()
        fd = os.open(self.path(task_id), os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_FILE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            size = os.fstat(fd).st_size
            events = [part for e in events for part in bound_event(e, MAX_EVENT_BYTES)]
            data = "".join(encode(e) + "\n" for e in events).encode()
            if size + len(data) > self.max_bytes:
                kept = [e for e in events if e.get("type") not in DELTAS]
                data = "".join(encode(e) + "\n" for e in kept).encode()
                if size <= self.max_bytes:
                    # said once: padded past the bound (blank lines, which readers skip, each
                    # within a line's bound), so the next writer sees the file full
                    truncated = encode({"type": "truncated", "task_id": task_id}) + "\n"
                    data = truncated.encode() + _pad(self.max_bytes - size) + data
                if not kept and size > self.max_bytes:
                    return
                if size + len(data) > self.max_bytes * 5 // 4:
                    return
            os.write(fd, data)
        finally:
            os.close(fd)  # releases the lock

    def read(self, task_id: str, after: str | None, block: float) -> list[StreamEvent]:
        start = _offset(after)
        deadline = time.monotonic() + block
        path = self.path(task_id)
        while True:
            events = self._read_from(path, start)
            if events or time.monotonic() >= deadline:
                return events
            time.sleep(POLL_SECONDS)

    def _read_from(self, path: Path, start: int) -> list[StreamEvent]:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if start > size:  # expired and written again since: the new log from its start
                    start = 0
                f.seek(start)
                chunk = f.read(READ_CHUNK)
                end = chunk.rfind(b"\n")
                # a line longer than a chunk (written before lines were bounded): read on to
                # its end, whatever its length, rather than wait for good for a newline
                while end < 0 and len(chunk) < size - start:
                    more = f.read(READ_CHUNK)
                    if not more:
                        break
                    newline = more.find(b"\n")
                    chunk += more
                    if newline >= 0:
                        end = len(chunk) - len(more) + newline
        except FileNotFoundError:
            return []
        if end < 0:
            return []
        events: list[StreamEvent] = []
        position = start
        for line in chunk[: end + 1].splitlines(keepends=True):
            position += len(line)
            data = decode(line)
            if data is not None:
                events.append(StreamEvent(str(position), data))
        return events

    def _sweep(self) -> None:
        now = time.time()
        if now - self._swept < SWEEP_EVERY:
            return
        self._swept = now
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return
        for entry in entries:
            try:
                if entry.name.endswith(".jsonl") and entry.stat().st_mtime < now - self.ttl:
                    os.unlink(entry.path)
            except OSError:
                pass  # another process removed it first

    def close(self) -> None:
        pass


def _pad(size: int) -> bytes:
    """``size`` bytes (at least one line) of blank lines, none longer than an event may be."""
    line = b" " * (MAX_EVENT_BYTES - 1) + b"\n"
    whole, rest = divmod(max(1, size), MAX_EVENT_BYTES)
    return line * whole + (b" " * (rest - 1) + b"\n" if rest else b"")


def _offset(after: str | None) -> int:
    if after is None or after == "":
        return 0
    try:
        value = int(after)
    except ValueError:
        raise ValueError(f"{after!r} is not an offset of a file stream (a byte position)") from None
    if value < 0:
        raise ValueError(f"{after!r} is not an offset of a file stream (a byte position)")
    return value
