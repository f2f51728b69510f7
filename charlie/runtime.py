"""A process's runtime: settings, engine, publisher, and for a worker its identity and adapters.

Two faces, each built once per process (and again in each forked pool child); these and the
Celery app are the only process-wide state:

- :class:`Producer` (:func:`get_producer`): what submitting and reading tasks needs, the
  database and the broker. Building it imports no tool module and nothing of the executor, so
  a web app that calls ``charlie.submit`` loads neither.
- :class:`Runtime` (:func:`get_runtime`): a worker's, which adds its identity, its tools
  (``CHARLIE_TOOL_MODULES``), its models, its lease keeper and the phases' ports.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING

from charlie import agents, home
from charlie.capacity import FleetLimits
from charlie.config import TICK_QUEUE, Settings, broker_priority, queue_mismatch_hint, settings
from charlie.domain import Phase
from charlie.leases import LeaseKeeper
from charlie.limits import limit_table
from charlie.models import Model, resolve_model
from charlie.observe import NOOP, Observer
from charlie.ports import NO_LIMITS, CapacityPort, PhaseDeps, PhaseLimits
from charlie.presence import Presence, schema_fit
from charlie.scheduler import DbScheduler
from charlie.store import scans
from charlie.store.engine import (
    PoolLimits,
    Prepare,
    SchemaMissing,
    dispose_after_fork,
    ensure_schema,
    get_engine,
    read,
)
from charlie.store.revisions import SchemaFit
from charlie.store.transcripts import TranscriptCache
from charlie.store.types import Engine
from charlie.streams.base import Transport
from charlie.streams.open import open_transport
from charlie.streams.sink import NO_EVENTS, EventSink, TaskEvents
from charlie.tools.registry import REGISTRY, ToolRegistry

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger("charlie.runtime")


class Publisher:
    """Publishes ticks and invocations. Called only after the commit that makes them valid;
    a failure here loses a message, which the sweep finds again (I4).

    ``priority``: the task's (``submit(priority=...)``), read from the row the publish site
    has already read; sent as the broker's priority where it has them
    (``Settings.broker_priorities``). None sends none: inside a worker's task Celery gives the
    message the priority of the one that task came from (``task_inherit_parent_priority``),
    the same run's, which its own publishes keep without a read."""

    def __init__(self, app: Celery, levels: tuple[int, ...] = ()) -> None:
        self.app = app
        self.levels = levels

    def tick(
        self,
        execution_id: str,
        phase: Phase,
        version: int,
        *,
        durable: bool = False,
        priority: int | None = None,
    ) -> bool:
        """``durable``: the worker commits its claim (and the attempt) before running the
        phase, so a tick that kills its worker is counted wherever it dies (the sweep's
        re-publishes; poison messages)."""
        args = (execution_id, version, True) if durable else (execution_id, version)
        return self._send(f"charlie.phase.{phase.value}", args, priority=priority)

    def invoke(
        self,
        execution_id: str,
        turn: int,
        call_id: str,
        mode: str = "start",
        *,
        priority: int | None = None,
    ) -> bool:
        return self._send(
            "charlie.tool.invoke", (execution_id, turn, call_id, mode), priority=priority
        )

    def many(
        self, messages: Iterable[tuple[str, tuple[object, ...]]], *, priority: int | None = None
    ) -> None:
        """Messages of one run, with its priority."""
        with self.app.producer_or_acquire() as producer:
            for name, args in messages:
                self._send(name, args, producer=producer, priority=priority)

    def _send(
        self,
        name: str,
        args: tuple[object, ...],
        producer: object = None,
        priority: int | None = None,
    ) -> bool:
        try:
            if priority is None or not self.levels:
                self.app.send_task(name, args=args, producer=producer)
            else:
                level = broker_priority(priority, self.levels)
                self.app.send_task(name, args=args, producer=producer, priority=level)
            return True
        except Exception as exc:
            log.exception(
                "publish failed; the sweep will re-publish%s",
                queue_mismatch_hint(exc),
                extra={"task": name},
            )
            return False


@dataclass
class Producer:
    """What a producer needs: the settings, the database and the broker."""

    settings: Settings
    engine: Engine
    publisher: Publisher

    @property
    def stall(self) -> timedelta:
        """CHARLIE_STALL_SECONDS: how long work may look stalled before the sweeps act on it."""
        return timedelta(seconds=self.settings.stall_seconds)

    def poke(self, task_ids: list[str]) -> None:
        """Publish the current tick of these tasks' runs so they reach a boundary now (a
        cancel, a timeout: I18). Lost, the sweep's "stopping" clause publishes it later."""
        if not task_ids:
            return
        with read(self.engine) as conn:
            rows = scans.current_ticks(conn, task_ids)
        for row in rows:
            self.publisher.tick(row.id, Phase(row.phase), row.version, priority=row.priority)

    @cached_property
    def streams(self) -> Transport | None:
        """The transport of the events people watch (charlie/streams), or None when streaming
        is off or this broker cannot carry them (settings.stream_target)."""
        target = self.settings.stream_target
        if target is None:
            return None
        return open_transport(
            target, ttl=self.settings.stream_ttl, max_events=self.settings.stream_max_events
        )

    @cached_property
    def events(self) -> EventSink:
        """Where this process sends what people may watch (a worker's steps, a person's
        verdicts): appended, never read back (I28)."""
        transport = self.streams
        return NO_EVENTS if transport is None else TaskEvents(transport)


@dataclass
class Runtime(Producer):
    """A worker's runtime: a producer's, plus who it is, its tools and its models."""

    worker: str
    tools: ToolRegistry
    _models: dict[str, Model] = field(default_factory=dict)
    #: when this process last recorded each sweep's heartbeat (time.monotonic()).
    heartbeats_sent: dict[str, float] = field(default_factory=dict)
    #: when this process's stalled-run sweep last probed the runs in await_tools
    #: (time.monotonic(); CHARLIE_SWEEP_PROBE_SECONDS).
    probed_at: float | None = None
    #: a worker main process's heartbeat in the database (charlie/presence.py), once ready.
    presence: Presence | None = None
    #: telemetry (charlie.telemetry installs one per process from the environment): spans and
    #: metrics around ticks, model calls, tool calls and sweeps; by default nothing, at no cost.
    observer: Observer = NOOP
    #: each recent run's committed transcript as this process saw it (store.transcripts)
    transcripts: TranscriptCache = field(default_factory=TranscriptCache)

    def model_for(self, spec: str) -> Model:
        model = self._models.get(spec)
        if model is None:
            if agents.is_agent_spec(spec):
                # a framework agent's task: its own model object, its tools registered here
                model = agents.model_for(spec, self.tools)
            else:
                model = resolve_model(spec)
            if self.observer.enabled:
                model = self.observer.wrap_model(spec, model)
            self._models[spec] = model
        return model

    @cached_property
    def leases(self) -> LeaseKeeper:
        """Renews the leases this process's work holds (one thread for all of them)."""
        return LeaseKeeper(self.engine)

    @cached_property
    def deps(self) -> PhaseDeps:
        """The phases' adapters: built once per process, not per tick."""
        return self.phase_deps()

    def phase_deps(self) -> PhaseDeps:
        s = self.settings
        return PhaseDeps(
            model_for=self.model_for,
            tools=self.tools,
            scheduler=DbScheduler(self.engine),
            limits=PhaseLimits(
                dispatch_batch=s.dispatch_batch,
                tool_deadline=s.tool_deadline,
                human_deadline=s.human_deadline,
                report_retries=s.report_retries,
                model_retry_seconds=s.model_retry_seconds,
                context_tokens=s.model_context_tokens,
                context_tokens_by_model=s.context_tokens_by_model,
            ),
            events=self.events,
            capacity=self.capacity(),
            worker=self.worker,
        )

    def capacity(self) -> CapacityPort:
        """The provider limits the fleet keeps; none declared, nothing is counted."""
        s = self.settings
        table = limit_table(s.model_limits)
        if not table:
            return NO_LIMITS
        publisher = self.publisher
        return FleetLimits(
            self.engine,
            table,
            lambda xid, version, priority: publisher.tick(
                xid, Phase.CALL_MODEL, version, priority=priority
            ),
            s.lease_seconds,
            s.stall_seconds,
            lambda: self.observer,
        )


_runtime: Runtime | None = None
_producer: Producer | None = None
#: called with each worker runtime this process builds (the worker shell's telemetry)
_built_hooks: list[Callable[[Runtime], object]] = []
_mcp_discovered = False
_lock = threading.Lock()


def import_tool_modules(modules: Iterable[str]) -> None:
    import charlie.tools  # noqa: F401  (the built-ins)

    # A framework agent's tools are found by name when first named (charlie.agents).
    REGISTRY.add_finder(agents.find_tool)
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ImportError(
                f"CHARLIE_TOOL_MODULES names {name!r}, which cannot be imported: {exc}"
            ) from exc
        agents.register_module_agents(module, REGISTRY)


def check_worker_ready(s: Settings) -> None:
    """What a worker needs before it consumes anything: Charlie's schema in the database
    (brought to head first on the embedded SQLite default) and every module of
    CHARLIE_TOOL_MODULES imported, and CHARLIE_MODEL_LIMITS readable (a worker that could not
    read them would fail every model call it took). Raises SchemaMissing, ImportError or
    LimitsError, each naming the fix.

    On a server database only a schema never migrated stops the worker here: one behind this
    code or past its floor is a rolling upgrade in progress, and the worker waits for it to fit
    (presence.wait_until_schema_fits), saying why in its heartbeat."""
    if s.is_sqlite:
        _database_ready(s)
    else:
        home.prepare(s.home)
        fit = schema_fit(database_engine(s))
        if fit.fit is SchemaFit.NOT_MIGRATED:
            raise SchemaMissing(
                f"the database has no Charlie schema (this code needs {fit.code}): run "
                "`charlie db upgrade` first"
            )
    import_tool_modules(s.tool_modules)
    limit_table(s.model_limits)


def tick_queue_problem(app: Celery, s: Settings) -> str | None:
    """On RabbitMQ, why the tick queue cannot be declared as this process declares it (its
    x-max-priority, CHARLIE_RABBITMQ_MAX_PRIORITY, not the existing queue's), or None. Every
    consumer and producer declares it; a mismatch refuses each of them, so a worker says what
    to do before it starts rather than failing its connection over and over. A broker that
    cannot be reached is not this check's to report (the worker retries it)."""
    if not s.is_rabbitmq:
        return None
    queue = app.amqp.queues[TICK_QUEUE]
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)
            queue.bind(conn.default_channel).declare()
    except Exception as exc:
        hint = queue_mismatch_hint(exc)
        return f"{str(exc).splitlines()[0]}{hint}" if hint else None
    return None


def database_engine(s: Settings) -> Engine:
    """This process's engine, its pool bounded by CHARLIE_DB_POOL_SIZE and
    CHARLIE_DB_MAX_OVERFLOW (the connection budget)."""
    return get_engine(
        s.database_url, PoolLimits(s.db_pool_size, s.db_max_overflow), Prepare(s.db_prepare)
    )


def _database_ready(s: Settings) -> Engine:
    home.prepare(s.home)
    engine = database_engine(s)  # made first, so that the pool has the configured limits
    ensure_schema(s.database_url, auto_upgrade=s.is_sqlite, lock_dir=s.home)
    return engine


def get_producer() -> Producer:
    """The producer face: the worker's runtime where one is built, else database + broker."""
    global _producer
    with _lock:
        if _runtime is not None:
            return _runtime
        if _producer is None:
            from charlie.app import app

            s = settings()
            _producer = Producer(
                settings=s, engine=_database_ready(s), publisher=Publisher(app, s.broker_priorities)
            )
        return _producer


def discover_mcp_tools(s: Settings) -> None:
    """Register the tools of the configured MCP servers (CHARLIE_MCP_CONFIG /
    CHARLIE_MCP_SERVERS) in this process, keeping their sessions for the calls; a server that
    is down is tried again later (charlie.mcp.start). Nothing is imported without a config."""
    if s.mcp_config or s.mcp_servers:
        from charlie import mcp

        mcp.start(s, REGISTRY)


def get_runtime(*, mcp: bool = True) -> Runtime:
    """This process's worker runtime. ``mcp=False``: without discovering MCP servers yet (a
    prefork worker's main process, which runs no tool; the beat, whose sweeps leave a call of an
    MCP tool they find orphaned to a worker that has its implementation). The
    first ``get_runtime()`` of a process that runs tools discovers them."""
    global _runtime, _mcp_discovered
    with _lock:
        if _runtime is None:
            from charlie.app import app

            s = settings()
            engine = _database_ready(s)
            import_tool_modules(s.tool_modules)
            _runtime = Runtime(
                settings=s,
                engine=engine,
                worker=f"{socket.gethostname()}:{os.getpid()}",
                publisher=Publisher(app, s.broker_priorities),
                tools=REGISTRY,
            )
            for hook in _built_hooks:
                hook(_runtime)
        if mcp and not _mcp_discovered:
            discover_mcp_tools(_runtime.settings)
            _mcp_discovered = True
        return _runtime


def when_built(hook: Callable[[Runtime], object]) -> None:
    """Call ``hook`` with every worker runtime this process builds from now on (and again
    in each forked pool child, which builds its own)."""
    if hook not in _built_hooks:
        _built_hooks.append(hook)


def current() -> Runtime | None:
    """This process's runtime if one was built (a shutdown hook must not build one)."""
    return _runtime


def reset_after_fork() -> None:
    global _runtime, _producer, _mcp_discovered
    dispose_after_fork()
    _runtime = None
    _producer = None
    _mcp_discovered = False
    mcp = sys.modules.get("charlie.mcp")
    if mcp is not None:
        mcp.reset_after_fork()
