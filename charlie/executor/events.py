"""Celery task events for steps run inline, so Flower still shows each phase (I21).

A step run inline (see ``CHARLIE_INLINE_PHASES``: a phase, or a turn's only tool call) is
claimed, committed and recorded like any other, but no message carried it, so no worker
reported it as a task. Where task events are on, this reports it as one: a ``task-succeeded``
(or ``task-failed``) event under its own task name (``charlie.phase.<phase>``,
``charlie.tool.invoke``) and a task id of its own, carrying the fields a ``task-received`` and
``task-started`` would have carried, with the task that ran it as its parent. Flower and
``celery events`` then list it beside the published ones.
"""

from __future__ import annotations

import logging
import time
import traceback
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from celery import current_task

if TYPE_CHECKING:
    from charlie.runtime import Runtime

log = logging.getLogger("charlie.events")


@dataclass
class Report:
    """What the reported task returned, for its ``task-succeeded`` event."""

    result: str = "None"


@dataclass
class InlineReports:
    """The events of the phases one task ran inline, sent together once it is done.

    Sending them as each phase ends would put a broker round trip between every inline phase
    and the next; sent at the end, after the task's last publish, they overlap with the next
    task's trip through the broker instead."""

    rt: Runtime
    pending: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    #: the Celery task that runs these steps, taken when it makes this (the thread that runs
    #: a step of it may be another: a turn's local calls run at once, a thread each)
    parent: Any = None

    def __post_init__(self) -> None:
        if self.parent is None and current_task:
            self.parent = current_task.request

    @contextmanager
    def task(self, name: str, args: tuple[object, ...]) -> Iterator[Report]:
        """Report the block as the task ``name(*args)`` (``charlie.phase.<phase>`` or
        ``charlie.tool.invoke``).

        One event for it (a worker sends three for a task it received): the fields a
        ``task-received`` and a ``task-started`` would carry ride on the ``task-succeeded`` or
        ``task-failed`` event, whose fields Celery's event state merges into the task."""
        report = Report()
        parent = self.parent
        if not self.rt.settings.task_events or parent is None or parent.id is None:
            yield report
            return
        received = time.time()
        started = time.monotonic()
        fields: dict[str, Any] = {
            "uuid": str(uuid.uuid4()),
            "name": name,
            "args": repr(args),
            "kwargs": "{}",
            "retries": 0,
            "root_id": parent.root_id or parent.id,
            "parent_id": parent.id,
            "hostname": parent.hostname,
            "received": received,
            "started": received,
        }
        try:
            yield report
        except BaseException as exc:
            fields.update(
                exception=repr(exc), traceback="".join(traceback.format_exception(exc))[-4000:]
            )
            self.pending.append(("task-failed", fields))
            raise
        fields.update(result=repr(report.result), runtime=time.monotonic() - started)
        self.pending.append(("task-succeeded", fields))

    def send(self) -> None:
        """Best effort: an event that cannot be sent is logged and the run goes on.

        All in one message: Celery's event dispatcher buffers the ``task`` group and publishes
        the buffer as one ``task-multi`` message, a list Celery's event receiver (Flower's,
        ``celery events``) takes apart, so a chain of inline steps costs one publish, not one
        per step."""
        if not self.pending:
            return
        events, self.pending = self.pending, []
        try:
            app = self.rt.publisher.app
            hostname = events[0][1]["hostname"]
            with (
                app.amqp.producer_pool.acquire(block=True) as producer,
                app.events.Dispatcher(
                    producer.connection,
                    hostname,
                    channel=producer.channel,
                    buffer_while_offline=False,
                    buffer_group=frozenset({"task"}),
                    buffer_limit=len(events) + 1,
                ) as dispatcher,
            ):
                for event, fields in events:
                    dispatcher.send(event, **{k: v for k, v in fields.items() if k != "hostname"})
                dispatcher.flush(errors=False)
        except Exception:
            log.warning("task events of inline phases not sent", exc_info=True)


__all__ = ["InlineReports", "Report"]
