"""The transport a URL names."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from charlie.streams.base import Transport


def open_transport(url: str, *, ttl: float, max_events: int) -> Transport:
    """``redis://``, ``rediss://``, ``unix://`` (Redis), ``amqp://``, ``amqps://``,
    ``pyamqp://`` (a RabbitMQ stream queue) or ``file://DIR``."""
    if url.startswith("file://"):
        from charlie.streams.files import FileTransport

        return FileTransport(Path(unquote(urlsplit(url).path)), ttl=ttl, max_events=max_events)
    if url.startswith(("amqp://", "amqps://", "pyamqp://")):
        from charlie.streams.rabbitmq_stream import RabbitStreamTransport

        return RabbitStreamTransport(url, ttl=ttl, max_events=max_events)
    from charlie.streams.redis_stream import RedisTransport

    return RedisTransport(url, ttl=ttl, max_events=max_events)
