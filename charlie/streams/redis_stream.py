"""A Redis Stream per task: the production transport (any number of machines).

``charlie:events:<task id>``: each event one entry (field ``e``, the JSON), added with
``XADD ... MAXLEN ~ max_events`` (bounded: Redis drops the oldest whole nodes) and the key's
``EXPIRE`` refreshed in the same round trip at most every few seconds (expiring: a task nobody
writes to is gone ``ttl`` seconds later). Offsets are the entry ids; a follower waits with
``XREAD BLOCK``.
"""

from __future__ import annotations

import re
import time
from typing import Any

import redis

from charlie.streams.base import StreamEvent, StreamUnavailable, decode, encode

KEY_PREFIX = "charlie:events:"
#: the key's expiry is refreshed when it is older than this part of the ttl
REFRESH_PART = 0.1
READ_COUNT = 1000
_ID = re.compile(r"\d+(-\d+)?")


class RedisTransport:
    name = "redis"

    def __init__(self, url: str, *, ttl: float, max_events: int) -> None:
        self.ttl = max(1, int(ttl))
        self.max_events = max_events
        self._client: redis.Redis = redis.Redis.from_url(
            url, socket_connect_timeout=5, socket_timeout=30, health_check_interval=30
        )
        #: when this process last refreshed each key's expiry (time.monotonic())
        self._refreshed: dict[str, float] = {}

    def key(self, task_id: str) -> str:
        return KEY_PREFIX + task_id

    def append(self, task_id: str, events: list[dict[str, Any]]) -> None:
        key = self.key(task_id)
        pipe = self._client.pipeline(transaction=False)
        for event in events:
            pipe.xadd(key, {"e": encode(event)}, maxlen=self.max_events, approximate=True)
        now = time.monotonic()
        if now - self._refreshed.get(key, -1e9) > self.ttl * REFRESH_PART:
            pipe.expire(key, self.ttl)
            self._refreshed[key] = now
            if len(self._refreshed) > 10000:
                self._refreshed.clear()
        pipe.execute()

    def read(self, task_id: str, after: str | None, block: float) -> list[StreamEvent]:
        start = after or "0-0"
        if not _ID.fullmatch(start):
            raise ValueError(f"{after!r} is not an offset of a Redis stream (an entry id)")
        wait = int(block * 1000)
        try:
            answer: Any = self._client.xread(
                {self.key(task_id): start}, count=READ_COUNT, block=wait if wait > 0 else None
            )
        except redis.RedisError as exc:
            raise StreamUnavailable(f"the event stream could not be read: {exc}") from exc
        events: list[StreamEvent] = []
        for _key, entries in answer or []:
            for entry_id, fields in entries:
                raw = fields.get(b"e")
                data = decode(raw) if raw is not None else None
                if data is not None:
                    offset = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                    events.append(StreamEvent(offset, data))
        return events

    def close(self) -> None:
        self._client.close()
