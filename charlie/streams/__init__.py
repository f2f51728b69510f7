"""Streaming for people watching: what a run does as it does it, outside the database.

A worker appends events to a per-task log on a transport (:mod:`charlie.streams.base` says
what one is): the model's text, reasoning and tool-call argument deltas while it writes them,
each model call's start and end, tool calls as they are made, start and settle, waits for
people, and the task's end. A reader (``charlie.events``, ``charlie watch``, the console)
follows a task from an offset, so one that connects late or reconnects gets what it missed.

Nothing here is the record (I28): no phase reads an event and no recovery depends on one; the
answer is the durable final item, written once (I16). An event costs no database write and no
commit; the tool, wait and end events are appended after the commit that records them, never
before, so a reader never sees what did not commit. The logs are bounded (oldest events
dropped) and expire when nobody writes to them.

Transports: :mod:`charlie.streams.redis_stream` (a Redis Stream per task; production) and
:mod:`charlie.streams.files` (an append-only file per task under CHARLIE_HOME; the embedded
default, one machine). :func:`charlie.streams.open.open_transport` picks one from a URL.
"""
