"""The worker shell: every Celery task and signal hook Charlie declares, and nothing else.

- ``charlie.phase.<phase>``: one task per phase (I21). A message carries (execution_id,
  version); the task name is the phase. Each is a thin shell over
  :func:`charlie.executor.tick.run_tick`, safe to run twice, late or never (I2).
- ``charlie.tool.invoke``: one tool call (start, resume, reconcile or observe).
- ``charlie.sweep.*``: the beat sweeps, on their own queue (celeryconfig.task_routes).
- ``charlie.submit``: a task submitted by a producer that has only Celery; and the people in
  the loop's actions, by the same names as the API: ``charlie.send``, ``charlie.reply``,
  ``charlie.approve``, ``charlie.deny``, ``charlie.reconcile``, ``charlie.resume``,
  ``charlie.fork``, ``charlie.cancel``.
- the signal hooks: structured logs, a fresh runtime per forked child, fail fast when ready.

The app (:mod:`charlie.app`) includes this module, so a worker registers all of these; a
producer that only submits never imports it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from celery import Task
from celery.signals import (
    after_setup_logger,
    after_setup_task_logger,
    celeryd_after_setup,
    task_postrun,
    task_prerun,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)
from celery.worker.request import Request

from charlie import logs, redact, runtime, sweeps, telemetry
from charlie.app import app
from charlie.config import settings
from charlie.domain import Channel, Origin, Phase
from charlie.executor import tick
from charlie.limits import LimitsError
from charlie.models import inflight
from charlie.presence import Presence, wait_until_schema_fits
from charlie.runtime import get_runtime
from charlie.store.engine import SchemaMissing
from charlie.store.revisions import SchemaCheck
from charlie.store.types import DatabaseUnavailable
from charlie.streams.sink import EXIT_WAIT

INVOKE_MODES = ("start", "resume", "reconcile", "observe", "cancel")

# Every runtime a worker process builds gets the telemetry its environment asks for (OTEL_*,
# CHARLIE_METRICS_PORT); a forked pool child builds its own, with its own exporter thread.
runtime.when_built(telemetry.install)


def _phase_task(phase: Phase) -> Task:
    def run(self: Task, execution_id: str, version: int, durable: bool = False) -> str:
        # A redelivered message (RabbitMQ gives back a dead worker's unacked message at once),
        # or a tick the sweep re-published (``durable``), may be the one that killed a worker:
        # its claim is committed on its own, so the attempt is counted even if this worker dies
        # too (poison messages), and a tick that merely waited in a busy queue counts none.
        redelivered = bool((self.request.delivery_info or {}).get("redelivered"))
        rt = get_runtime()
        result = tick.run_tick(
            rt, execution_id, phase, version, durable_claim=redelivered or durable
        )
        _run_handed_over(rt)
        return result

    run.__name__ = phase.value
    run.__doc__ = f"Run the {phase.value} phase of one execution at one version."
    return app.task(name=f"charlie.phase.{phase.value}", ignore_result=True, bind=True)(run)


PHASE_TASKS = {phase: _phase_task(phase) for phase in Phase if phase is not Phase.DONE}


@app.task(name="charlie.tool.invoke", ignore_result=True)
def invoke_task(execution_id: str, turn: int, call_id: str, mode: str = "start") -> str:
    if mode not in INVOKE_MODES:
        raise ValueError(f"unknown invoke mode {mode!r}")
    rt = get_runtime()
    result = tick.invoke(rt, execution_id, turn, call_id, mode)  # type: ignore[arg-type]
    _run_handed_over(rt)
    return result


#: how long a task goes on running the model calls its releases woke
HANDOVER_SECONDS = 30.0


def _run_handed_over(rt: runtime.Runtime) -> None:
    """Run here the model calls this process woke by releasing a provider limit's slot
    (charlie/capacity.py): a freed slot is taken at once, not after the woken tick has crossed
    a busy queue. Their ticks were published too, so whichever comes second is stale (I2);
    for a while only, then the published ticks carry on."""
    deadline = time.monotonic() + HANDOVER_SECONDS
    capacity = rt.deps.capacity
    while time.monotonic() < deadline:
        handed = capacity.handed_over()
        if not handed:
            return
        for execution_id, version in handed:
            tick.run_tick(rt, execution_id, Phase.CALL_MODEL, version, inline_first=True)


# The sweeps as Celery tasks, for `celery -A charlie.app beat` (celeryconfig's beat_schedule):
# they then queue on charlie.sweeps for the workers' pools. `charlie beat` runs them in its own
# process instead (sweeps.run_beat), so recovery never waits for a free slot.
@app.task(name="charlie.sweep.stalled_runs", ignore_result=True)
def stalled_runs() -> object:
    return sweeps.run_sweep(get_runtime(), "sweep.stalled_runs")


@app.task(name="charlie.sweep.tool_calls", ignore_result=True)
def tool_call_sweep() -> object:
    return sweeps.run_sweep(get_runtime(), "sweep.tool_calls")


@app.task(name="charlie.sweep.task_timeouts", ignore_result=True)
def task_timeouts() -> object:
    return sweeps.run_sweep(get_runtime(), "sweep.task_timeouts")


class _SubmitTask(Task):  # type: ignore[misc]
    """``charlie.submit`` as sent from a Charlie process: its prompt and metadata do not ride
    in the message's repr headers, which task events carry to Flower (charlie/redact.py)."""

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        if "argsrepr" not in options or "kwargsrepr" not in options:
            argsrepr, kwargsrepr = redact.submit_reprs(args, kwargs)
            options.setdefault("argsrepr", argsrepr)
            options.setdefault("kwargsrepr", kwargsrepr)
        return super().apply_async(args, kwargs, **options)


class _SubmitRequest(Request):  # type: ignore[misc]
    """The worker's view of a received ``charlie.submit``: whatever repr its producer sent (a
    plain Celery app sends the prompt), the events and inspection show the redacted one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._argsrepr, self._kwargsrepr = redact.submit_reprs(self._args, self._kwargs)


# A submit that finds the database unreachable is published again with backoff (2 s doubling
# to 60 s, about 10 minutes in all) before the message is given up with an error naming the
# task; the countdowns stay far below Redis's visibility timeout (6 hours, set in
# celeryconfig.py).
@app.task(
    name="charlie.submit",
    base=_SubmitTask,
    Request=_SubmitRequest,
    ignore_result=True,
    bind=True,
    autoretry_for=(DatabaseUnavailable,),
    retry_backoff=2,
    retry_backoff_max=60,
    max_retries=15,
)
def submit_task(
    self: Task,
    prompt: str,
    *,
    model: str | None = None,
    task_id: str | None = None,
    tools: list[str] | None = None,
    timeout: float | None = None,
    metadata: dict[str, object] | None = None,
    approve: list[str] | None = None,
    budget: dict[str, object] | None = None,
    priority: int = 0,
    agent: str | None = None,
    deps: str | None = None,
    usage_limits: dict[str, int] | None = None,
) -> str:
    """Start a Charlie task from a producer that has only Celery: ``submit_task.delay(...)`` or
    ``app.send_task("charlie.submit", kwargs=...)``, which a plain Celery app sends to its default
    queue (``celery``), which Charlie's workers consume too.

    The task's id is ``task_id`` if given, else the Celery message's own id
    (``send_task(..., task_id=...)``, or the one Celery generated): a redelivered or retried
    message then submits nothing twice, and the producer's ``AsyncResult.id`` is the Charlie
    task's id."""
    from charlie.api import submit  # the producer face; a worker imports it when first used

    # A producer's trace context, sent as the message's W3C headers (send_task(...,
    # headers={"traceparent": ...})), parents the task as a Python producer's span does.
    with telemetry.producer_context(self.request):
        return submit(
            prompt,
            model=model,
            tools=tools,
            task_id=task_id or self.request.id,
            timeout=timeout,
            metadata=metadata,
            approve=approve,
            budget=budget,
            priority=priority,
            agent=agent,
            deps=deps,
            usage_limits=usage_limits,
        )


# People in the loop as Celery tasks, for producers that have only Celery (I27):
# ``app.send_task("charlie.approve", args=[task_id, call_id], kwargs={"operator": "ana"})``.
# The message's id is the request's idempotency key, so a redelivered message acts once; a
# refused action (a second verdict, a finished task) is logged with its reason, not retried.
#
# The name such a message gives (``operator=``) is only claimed: anyone who can publish to the
# broker can send it. The record says so, channel ``celery``, not authenticated (I32), and a
# deployment that does not trust every broker client turns these tasks off
# (CHARLIE_CELERY_OPERATOR_ACTIONS=0), or requires signed messages (CHARLIE_SECURITY_*).
def _person_task(name: str, call: Any) -> Task:
    def run(self: Task, *args: Any, **kwargs: Any) -> Any:
        from charlie import people  # the producer face; imported when first used

        log = logging.getLogger("charlie.people")
        task_id = args[0] if args and isinstance(args[0], str) else None
        if not settings().celery_operator_actions:
            # Refused before anything is read or written: nothing is recorded (I32).
            log.warning(
                "%s refused: operator actions by Celery message are turned off "
                "(CHARLIE_CELERY_OPERATOR_ACTIONS=0); nothing was recorded (message %s)",
                name,
                self.request.id,
                extra={"task_id": task_id},
            )
            raise people.ActionRefused(
                f"{name}: operator actions by Celery message are turned off on this worker "
                "(CHARLIE_CELERY_OPERATOR_ACTIONS=0)"
            )
        if "origin" in kwargs:
            # How an action arrived is Charlie's to say, never the message's (I32).
            log.warning(
                "%s refused: the message names its own origin", name, extra={"task_id": task_id}
            )
            raise people.ActionRefused(f"{name}: a message cannot say how it arrived (origin)")
        kwargs["origin"] = Origin(Channel.CELERY, authenticated=False)
        kwargs.setdefault("request_id", self.request.id)
        try:
            result = call(people, *args, **kwargs)
        except people.ActionRefused as exc:
            log.warning("%s refused: %s", name, exc, extra={"task_id": task_id})
            raise
        return result if isinstance(result, str | bool | None) else getattr(result, "id", None)

    run.__name__ = name.rsplit(".", 1)[-1]
    run.__doc__ = f"Run charlie.{run.__name__} from a Celery message."

    class Redacted(Task):  # type: ignore[misc]
        # A message's text, a reply or a note must not ride in the event stream (redact.py).
        def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
            argsrepr, kwargsrepr = redact.person_reprs(name, args, kwargs)
            options.setdefault("argsrepr", argsrepr)
            options.setdefault("kwargsrepr", kwargsrepr)
            return super().apply_async(args, kwargs, **options)

    class RedactedRequest(Request):  # type: ignore[misc]
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            self._argsrepr, self._kwargsrepr = redact.person_reprs(name, self._args, self._kwargs)

    # As charlie.submit: a database that cannot be reached retries the message with backoff
    # (the same request id, so it acts once) rather than dropping a person's action.
    return app.task(
        name=name,
        base=Redacted,
        Request=RedactedRequest,
        ignore_result=True,
        bind=True,
        autoretry_for=(DatabaseUnavailable,),
        retry_backoff=2,
        retry_backoff_max=60,
        max_retries=15,
    )(run)


def _cancel(_: Any, task_id: str, **kwargs: Any) -> bool:
    from charlie.api import cancel

    return cancel(task_id, **kwargs)


PERSON_TASKS = {
    name: _person_task(name, call)
    for name, call in {
        "charlie.send": lambda p, *a, **k: p.send(*a, **k),
        "charlie.reply": lambda p, *a, **k: p.reply(*a, **k),
        "charlie.approve": lambda p, *a, **k: p.approve(*a, **k),
        "charlie.deny": lambda p, *a, **k: p.deny(*a, **k),
        "charlie.reconcile": lambda p, *a, **k: p.reconcile(*a, **k),
        "charlie.resume": lambda p, *a, **k: p.resume(*a, **k),
        "charlie.fork": lambda p, *a, **k: p.fork(*a, **k),
        "charlie.cancel": _cancel,
    }.items()
}


@after_setup_logger.connect
@after_setup_task_logger.connect
def _structured_logs(logger: logging.Logger, **_: Any) -> None:
    # Celery's format string prints no context; each line should say which run it is about.
    logs.install(logger, json_lines=settings().log_format == "json")


@celeryd_after_setup.connect
def _wait_for_schema(sender: Any = None, **_: Any) -> None:
    # Rolling upgrades: before it consumes anything, a worker whose code does not fit the
    # database's schema (newer: `charlie db upgrade` has not run yet; older than the schema's
    # floor) waits, saying why in its log and in its heartbeat (`charlie doctor`). The embedded
    # database is migrated by the worker itself (runtime).
    import threading

    s = settings()
    if s.is_sqlite:
        return
    node = str(sender) if sender else f"{socket.gethostname()}:{os.getpid()}"
    wait_until_schema_fits(runtime.database_engine(s), node, threading.Event())


def _stop_claiming(fit: SchemaCheck) -> None:
    # A `charlie db upgrade` raised the schema's floor past this worker's code: a warm
    # shutdown (the running tasks finish, nothing more is taken); restarted with the same code,
    # the worker waits in _wait_for_schema, listed by `charlie doctor`.
    logging.getLogger("charlie.presence").error(
        "stopping: this worker's code no longer fits the database (%s)", fit.why
    )
    os.kill(os.getpid(), signal.SIGTERM)


@celeryd_after_setup.connect
def _list_mcp_tools(**_: Any) -> None:
    # After logging is set up, before the pool forks: list the MCP servers' tools once, in the
    # main process, so every pool process inherits them (and the SDK, imported) instead of
    # each listing on its first task; the sessions end here, and each pool process connects
    # on its first call. A server that is down is listed again by the pool processes
    # (charlie.mcp.start).
    s = settings()
    if s.mcp_config or s.mcp_servers:
        from charlie import mcp
        from charlie.tools.registry import REGISTRY

        mcp.start(s, REGISTRY, keep=False)


@worker_init.connect
def _refuse_to_start_unready(**_: Any) -> None:
    # Before the worker consumes anything: one on a database without Charlie's schema, or that
    # cannot import a module of CHARLIE_TOOL_MODULES (it would take its tools' calls and fail
    # each as an unknown tool), or cannot read CHARLIE_MODEL_LIMITS (it would fail each model
    # call), must not start. An exception in worker_ready is only logged by
    # Celery, which then says the worker is ready; a SystemExit here is not caught by Celery's
    # signal dispatch: the worker stops with one line naming the cause. (A pool child that
    # forks later disposes of this process's connections: runtime.reset_after_fork.)
    try:
        runtime.check_worker_ready(settings())
        _check_tick_queue()
    except (SchemaMissing, LimitsError) as exc:
        logging.getLogger("charlie.worker").critical("%s", exc)
        raise SystemExit(f"charlie: {exc}") from None
    except ImportError as exc:
        logging.getLogger("charlie.worker").critical("%s", exc)
        raise SystemExit(
            f"charlie: {exc} (set PYTHONPATH to the module's directory, or install the package "
            "that provides it)"
        ) from None


def _check_tick_queue() -> None:
    """RabbitMQ: a tick queue declared with another x-max-priority than the broker's stops
    the worker with what to do (runtime.tick_queue_problem)."""
    problem = runtime.tick_queue_problem(app, settings())
    if problem:
        logging.getLogger("charlie.worker").critical("%s", problem)
        raise SystemExit(f"charlie: {problem}")


@worker_init.connect
def _serve_metrics(**_: Any) -> None:
    # CHARLIE_METRICS_PORT: the main process serves /metrics for its pool, and sets up the
    # directory the pool processes count into before it forks them (charlie.telemetry.metrics).
    # A port another process has stops the worker here, before it consumes anything.
    global _metrics_server
    try:
        _metrics_server = telemetry.serve_metrics("worker")
    except telemetry.MetricsError as exc:
        logging.getLogger("charlie.telemetry").critical("%s", exc)
        raise SystemExit(f"charlie: {exc}") from None


_metrics_server: Any = None


@worker_process_init.connect
def _after_fork(**_: Any) -> None:
    # A prefork child must open its own database connections and take its own worker identity,
    # and its own telemetry (exporter threads and sockets do not survive a fork): the runtime
    # it builds gets it (runtime.when_built above).
    runtime.reset_after_fork()


@worker_process_shutdown.connect
def _process_gone(pid: int | None = None, **_: Any) -> None:
    if _metrics_server is not None or telemetry.wanted():
        telemetry.process_exit(pid)


@worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    # Fail fast on a missing schema or a bad tool module. MCP servers were listed before the
    # pool forked (_list_mcp_tools); the pool processes connect to them.
    rt = get_runtime(mcp=False)  # with its telemetry (a threads or solo pool runs tasks here)
    if _metrics_server is not None:  # said again: this process's logging was not set up then
        logging.getLogger("charlie.telemetry").info(
            "serving Prometheus metrics on http://%s:%s/metrics",
            _metrics_server.host,
            _metrics_server.port,
        )
    # The main process says it is alive, and what it consumes, for `charlie doctor`.
    queues = [q.name for q in getattr(getattr(sender, "task_consumer", None), "queues", [])]
    node = getattr(sender, "hostname", None) or rt.worker
    on_unfit = None if rt.settings.is_sqlite else _stop_claiming
    rt.presence = Presence(
        rt.engine,
        node,
        queues,
        on_unfit=on_unfit,
        connections=_connection_budget(sender, rt),
        pool=_pool_report(sender),
    ).start()


def _pool_report(consumer: Any) -> Callable[[], tuple[str, int, int, int, str]]:
    """What the worker's heartbeat says of its pool: its kind and concurrency, and the model
    calls in flight now and at most since the last beat. A threads (or solo, gevent) pool runs
    them in this process, which counts them (charlie.models.inflight); a prefork pool's
    children count their own, out of sight here: its heartbeat counts the tasks running."""
    from celery.worker import state as worker_state

    controller = getattr(consumer, "controller", None)
    pool_cls = getattr(controller, "pool_cls", None)
    module = str(getattr(pool_cls, "__module__", ""))
    kind = module.rsplit(".", 1)[-1] if module else "unknown"
    kind = {"thread": "threads", "solo": "solo", "prefork": "prefork"}.get(kind, kind)
    concurrency = int(getattr(controller, "concurrency", 0) or 0)

    def report() -> tuple[str, int, int, int, str]:
        if kind == "prefork":
            running = len(worker_state.active_requests)
            return kind, concurrency, running, running, "tasks"
        return kind, concurrency, inflight.in_flight(), inflight.peak(reset=True), "model calls"

    return report


def _connection_budget(consumer: Any, rt: runtime.Runtime) -> int:
    """The most database connections this worker may hold: each process's pool
    (CHARLIE_DB_POOL_SIZE + CHARLIE_DB_MAX_OVERFLOW) times its processes (a prefork pool's
    children and the main process; threads share one pool)."""
    controller = getattr(consumer, "controller", None)
    pool_cls = getattr(controller, "pool_cls", None)
    concurrency = int(getattr(controller, "concurrency", 0) or 0)
    prefork = str(getattr(pool_cls, "__module__", "")).endswith("prefork")
    processes = concurrency + 1 if prefork and concurrency else 1
    return processes * (rt.settings.db_pool_size + rt.settings.db_max_overflow)


#: a running task's trace context, entered at its prerun and left at its postrun
_task_contexts: dict[str, Any] = {}


@task_prerun.connect
def _enter_trace(task_id: str = "", task: Any = None, args: Any = None, **_: Any) -> None:
    # Celery's own lines about a run's task (its success, its retry) say the run's trace too.
    name = getattr(task, "name", "") or ""
    if not (name.startswith("charlie.phase.") or name == "charlie.tool.invoke"):
        return
    if not args or not isinstance(args[0], str) or not args[0].startswith("x-"):
        return
    try:
        rt = get_runtime(mcp=False)  # the task itself needs it next
        if not rt.observer.enabled:
            return
        context = rt.observer.invocation(args[0], 0, "")
        context.__enter__()
    except Exception:
        logging.getLogger("charlie.telemetry").debug("no trace context", exc_info=True)
        return
    _task_contexts[task_id] = context


@task_postrun.connect
def _leave_trace(task_id: str = "", **_: Any) -> None:
    context = _task_contexts.pop(task_id, None)
    if context is not None:
        context.__exit__(None, None, None)


@worker_process_shutdown.connect
def _flush_telemetry(**_: Any) -> None:
    # A pool child that exits cleanly exports the spans it still holds (a SIGKILL loses them),
    # and sends the events its stream writer still holds: it leaves by os._exit, which runs
    # no atexit hook (I28: a watcher's stream, never the answer).
    rt = runtime.current()
    if rt is not None:
        rt.events.flush(EXIT_WAIT)
        telemetry.shutdown(rt)


@worker_shutdown.connect
def _shutdown(**_: Any) -> None:
    rt = runtime.current()
    if rt is not None and rt.presence is not None:
        rt.presence.stop()
    if rt is not None:
        rt.events.flush(EXIT_WAIT)
        telemetry.shutdown(rt)
    if _metrics_server is not None:
        _metrics_server.stop()
