"""An append-only file per task: the embedded default's transport (one machine).

``DIR/<sha256 of the task id>.jsonl``, one JSON event a line; the offset is the byte position
after an event. Every process on the machine appends with ``O_APPEND`` under an exclusive
``flock`` (a worker killed mid-write leaves at most a torn last line, which readers skip), and
readers follow by polling the file's size. Bounded: past ``max_events`` x 512 bytes a task's
deltas are dropped (a ``truncated`` event says so once) and only the other events are kept, up
to a quarter more. Expiring: any writer removes, at most once a minute, the files nobody has
written to for ``ttl`` seconds.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
from pathlib import Path
from typing import Any

from charlie.home import PRIVATE_FILE, private_dir
from charlie.streams.base import StreamEvent, decode, encode

#: the event types dropped first when a task's file is full
DELTAS = frozenset({"text", "reasoning", "tool_args"})
BYTES_PER_EVENT = 512
READ_CHUNK = 1 << 20
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
            data = "".join(encode(e) + "\n" for e in events).encode()
            if size + len(data) > self.max_bytes:
                kept = [e for e in events if e.get("type") not in DELTAS]
                if size <= self.max_bytes:
                    # said once: padded past the bound, so the next writer sees the file full
                    pad = " " * max(0, self.max_bytes - size)
                    kept.insert(0, {"type": "truncated", "task_id": task_id, "pad": pad})
                data = "".join(encode(e) + "\n" for e in kept).encode()
                if not kept or size + len(data) > self.max_bytes * 5 // 4:
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
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n")
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
