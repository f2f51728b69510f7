"""Prometheus metrics: counters and histograms of the work, gauges of the fleet.

Switched on by ``CHARLIE_METRICS_PORT``. Prefork-safe through prometheus_client's
multiprocess mode:

- the process that serves (a worker's main process, before its pool forks; the beat) creates a
  fresh directory of its own (under ``CHARLIE_METRICS_DIR``, else the system's temporary one),
  points ``PROMETHEUS_MULTIPROC_DIR`` at it before prometheus_client is first imported, and
  serves ``/metrics`` on ``CHARLIE_METRICS_HOST:CHARLIE_METRICS_PORT`` (default host
  127.0.0.1) with a collector that sums every process's files (:func:`serve`);
- each process that works (a prefork pool child, or the main process itself with
  ``--pool threads`` or ``solo``, or the beat) inherits the directory and records into it
  through the :class:`MetricsObserver` that :func:`charlie.telemetry.install` gives it. A
  child's counters outlive the child (a replaced child's files stay and are summed), so
  nothing counted is lost when a pool process is recycled or killed.

The port is taken or the process stops: a second worker on one machine with the same port
exits at once with an error naming it (give each its own, or run each in its own network
namespace). The beat serves on ``CHARLIE_BEAT_METRICS_PORT``, else on ``CHARLIE_METRICS_PORT`` + 1
(so a worker and a beat on one machine both serve with one setting).

Label values are bounded: tools by name only when the process has them registered (a model
may ask for any name: those count as ``unregistered``), models by their spec, sanitised and
cut to 100 characters; past :data:`LABEL_CAP` distinct values of one label a process counts
the rest as ``other``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from charlie import pricing
from charlie.domain import Phase
from charlie.observe import CallEvent, ModelCallEvent, Observer, SweepEvent, TickScope

log = logging.getLogger("charlie.telemetry")

#: serve Prometheus metrics at ``/metrics`` from every worker on this port (unset: no metrics).
PORT = "CHARLIE_METRICS_PORT"
#: the address the metrics are served on (default 127.0.0.1).
HOST = "CHARLIE_METRICS_HOST"
#: the port ``charlie beat`` serves its metrics and the fleet's gauges on (default the
#: workers' ``CHARLIE_METRICS_PORT`` + 1).
BEAT_PORT = "CHARLIE_BEAT_METRICS_PORT"
#: where each serving process makes its multiprocess directory (default the system's temporary
#: directory); removed at exit, and one a SIGKILL left is removed by the next start.
DIRECTORY = "CHARLIE_METRICS_DIR"
#: the fleet's gauges are read from the database at most this often (seconds, default 5).
GAUGE_SECONDS = "CHARLIE_METRICS_GAUGE_SECONDS"
MULTIPROC = "PROMETHEUS_MULTIPROC_DIR"

DEFAULT_HOST = "127.0.0.1"
#: the fleet's gauges are read from the database at most this often (seconds), by default.
DEFAULT_GAUGE_SECONDS = 5.0
#: distinct values one label takes in one process before the rest count as ``other``.
LABEL_CAP = 200

#: seconds; a tick is milliseconds, a model call seconds, a tool call anything up to hours.
PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
                 120, 300)  # fmt: skip
CALL_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600)
#: tokens of one model input: 1K to 1M
TOKEN_BUCKETS = (1000, 2000, 4000, 8000, 16000, 32000, 64000, 128000, 200000, 400000, 1000000)

#: results of a tick that ran a phase (a stale tick claimed nothing and ran nothing).
_RAN = frozenset({"moved", "waiting", "done", "lost_lease", "refused", None})


class MetricsError(RuntimeError):
    """Metrics were asked for and cannot be served (a port taken, a bad value)."""


def wanted(env: Mapping[str, str]) -> bool:
    return bool(env.get(PORT, "").strip())


def from_environment(env: Mapping[str, str]) -> MetricsObserver:
    """This process's observer: one per process (metric files are per process and per name)."""
    global _observer
    with _lock:
        if _observer is None or _observer_pid != os.getpid():
            _set_observer(MetricsObserver(gauge_seconds=_gauge_seconds(env)))
        assert _observer is not None
        return _observer


_observer: MetricsObserver | None = None
_observer_pid = 0
_lock = threading.Lock()


def _set_observer(observer: MetricsObserver) -> None:
    global _observer, _observer_pid
    _observer, _observer_pid = observer, os.getpid()


def _gauge_seconds(env: Mapping[str, str]) -> float:
    raw = env.get(GAUGE_SECONDS, "").strip()
    try:
        return float(raw) if raw else DEFAULT_GAUGE_SECONDS
    except ValueError:
        raise MetricsError(f"{GAUGE_SECONDS}={raw!r} is not a number of seconds") from None


def port_of(env: Mapping[str, str], name: str = PORT) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise MetricsError(f"{name}={raw!r} is not a TCP port")
    return port


def beat_port_of(env: Mapping[str, str]) -> int | None:
    """The beat's port: ``CHARLIE_BEAT_METRICS_PORT``, else the workers' port + 1.

    A worker and a beat on one machine given only ``CHARLIE_METRICS_PORT`` must both serve:
    the beat taking the workers' port would stop the worker that starts after it."""
    port = port_of(env, BEAT_PORT)
    if port is not None:
        return port
    workers = port_of(env)
    if workers is None:
        return None
    if workers == 65535:
        raise MetricsError(
            f"{PORT}=65535 leaves no port for the beat (it serves on {PORT} + 1): set {BEAT_PORT}"
        )
    return workers + 1


# -- serving -------------------------------------------------------------------------------


@dataclass
class Server:
    """A process's /metrics endpoint and the multiprocess directory it sums."""

    host: str
    port: int
    directory: str
    httpd: Any

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        shutil.rmtree(self.directory, ignore_errors=True)


def serve(port: int, env: Mapping[str, str], role: str) -> Server:
    """Serve /metrics for this process and every process it forks from now on.

    Call it before this process makes any metric of its own, and before forking."""
    host = env.get(HOST, "").strip() or DEFAULT_HOST
    base = env.get(DIRECTORY, "").strip() or None
    if base is not None:
        os.makedirs(base, exist_ok=True)
    _remove_stale(base or tempfile.gettempdir())
    directory = tempfile.mkdtemp(prefix=f"charlie-metrics-{role}-{os.getpid()}-", dir=base)
    os.environ[MULTIPROC] = directory
    from prometheus_client import values

    # prometheus_client may be imported already (Celery's command line loads Flower's plugin,
    # which imports it): pick the value class again, now that the directory is set. Metrics
    # made from here on write to the shared files (each metric reads values.ValueClass when it
    # is made; prometheus_client keeps that import style for this).
    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    try:
        httpd, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        shutil.rmtree(directory, ignore_errors=True)
        raise MetricsError(
            f"{role}: cannot serve metrics on {host}:{port} ({exc.strerror or exc}): another "
            f"process has that port; give each worker and beat on one machine its own "
            f"{PORT} (the beat: {BEAT_PORT})"
        ) from None
    log.info("serving Prometheus metrics on http://%s:%s/metrics", host, port)
    return Server(host, port, directory, httpd)


def _remove_stale(base: str) -> None:
    """Directories of serving processes that are gone (a SIGKILL leaves its directory)."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        match = _DIRECTORY_NAME.fullmatch(name)
        if match is None:
            continue
        try:
            os.kill(int(match[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        except OSError:
            pass  # alive (another user's): not ours to remove


_DIRECTORY_NAME = re.compile(r"charlie-metrics-(?:worker|beat)-(\d+)-\w+")


def process_exit(pid: int | None = None) -> None:
    """A pool process ends: drop its live gauges' files (its counters stay, and count)."""
    directory = os.environ.get(MULTIPROC)
    if directory and os.path.isdir(directory):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid or os.getpid(), directory)  # type: ignore[no-untyped-call]


# -- labels --------------------------------------------------------------------------------

_UNSAFE = re.compile(r"[^A-Za-z0-9._:/@+=-]")


class _Bounded:
    """Label values of one label, at most ``cap`` distinct ones per process."""

    def __init__(self, cap: int = LABEL_CAP) -> None:
        self.cap = cap
        self.seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self.seen:
            return value
        if len(self.seen) >= self.cap:
            return "other"
        self.seen.add(value)
        return value


def model_label(spec: str) -> str:
    return _UNSAFE.sub("_", spec)[:100] or "?"


def tool_label(name: str) -> str:
    from charlie.tools.registry import REGISTRY

    return name if REGISTRY.get(name) is not None else "unregistered"


# -- the observer --------------------------------------------------------------------------


class MetricsObserver(Observer):
    """Counts what the engine tells it (charlie.observe) into Prometheus metrics.

    ``registry``: where the metrics register (a test's own); None: nowhere, as in
    multiprocess mode, where the serving process's collector reads them from the files."""

    enabled = True

    def __init__(self, registry: Any = None, gauge_seconds: float = DEFAULT_GAUGE_SECONDS) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.gauge_seconds = gauge_seconds
        self._gauges_read = float("-inf")
        self._tools = _Bounded()
        self._models = _Bounded()

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return Counter(name, doc, labels, registry=registry)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            # One writer at a time (the beat): the latest value is the fleet's.
            return Gauge(name, doc, labels, registry=registry, multiprocess_mode="mostrecent")

        self.ticks = counter(
            "charlie_ticks", "Ticks run, by phase and result (tick.TickResult)", ("phase", "result")
        )
        self.transitions = counter(
            "charlie_transitions",
            "Committed transitions, by phase left and entered",
            ("phase", "to"),
        )
        self.phase_seconds = Histogram(
            "charlie_phase_duration_seconds",
            "A tick's duration (claim, phase, commit), by phase",
            ("phase",),
            buckets=PHASE_BUCKETS,
            registry=registry,
        )
        self.tool_calls = counter(
            "charlie_tool_calls",
            "Tool results as they enter the transcript (once each, whoever settled them), by "
            "tool and outcome",
            ("tool", "outcome"),
        )
        self.late_reports = counter(
            "charlie_tool_late_reports",
            "Reports of calls already settled (I12, I13), recorded and not applied",
            ("tool", "outcome"),
        )
        self.tool_seconds = Histogram(
            "charlie_tool_call_duration_seconds",
            "A tool handler's run, from its start to its result, by tool",
            ("tool",),
            buckets=CALL_BUCKETS,
            registry=registry,
        )
        self.model_calls = counter(
            "charlie_model_calls", "Model calls, by model and outcome (ok, retry, error)",
            ("model", "outcome"),
        )  # fmt: skip
        self.model_repeats = counter(
            "charlie_model_repeats",
            "Model calls made again because a crash lost their result before its commit (I3)",
        )
        self.tokens = counter(
            "charlie_tokens", "Tokens the models reported, by model and kind", ("model", "kind")
        )
        self.cost = counter(
            "charlie_cost_usd",
            "What the models' tokens cost in USD, by model, from the price table "
            "(CHARLIE_PRICES); models without a price are not counted",
            ("model",),
        )
        self.prices = _prices()
        self.model_seconds = Histogram(
            "charlie_model_call_duration_seconds",
            "A model call's duration, by model",
            ("model",),
            buckets=CALL_BUCKETS,
            registry=registry,
        )
        self.input_tokens = Histogram(
            "charlie_model_input_tokens",
            "The input tokens of each model call as its provider counted them, by model and "
            "purpose (turn, or a compaction's summary): under the model's context window (I29)",
            ("model", "purpose"),
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.compactions = counter(
            "charlie_compactions",
            "Compactions recorded (older turns summarised to fit the context window, I29), by "
            "model",
            ("model",),
        )
        self.compacted_tokens = counter(
            "charlie_compacted_tokens",
            "Estimated tokens of the model input before and after each compaction, by model",
            ("model", "when"),
        )
        self.fused_commits = counter(
            "charlie_fused_commits",
            "Fused commits sent (a merged transaction's steps in one statement, PostgreSQL), by "
            "commit and result (applied, or fell_back: the rows were not as predicted and the "
            "steps were written one by one)",
            ("commit", "result"),
        )
        self.sweep_actions = counter(
            "charlie_sweep_actions", "What the recovery sweeps did, by sweep and action",
            ("sweep", "action"),
        )  # fmt: skip
        self.model_limit_events = counter(
            "charlie_model_limit_events",
            "Model calls under a provider limit (CHARLIE_MODEL_LIMITS), by limit and event: "
            "granted, waited (held back: a stored wake-up), throttled (the provider refused "
            "one for load, 429 or 529, and every caller of the limit paused)",
            ("limit", "event"),
        )
        self.model_limit_in_flight = gauge(
            "charlie_model_limit_in_flight", "Model calls in flight under a limit", ("limit",)
        )
        self.model_limit_waiting = gauge(
            "charlie_model_limit_waiting", "Model calls waiting for a limit's capacity", ("limit",)
        )
        self.runs = gauge("charlie_runs", "Runs not done, by phase", ("phase",))
        self.tasks = gauge("charlie_tasks", "Tasks not finished, by status", ("status",))
        self.open_calls = gauge("charlie_open_tool_calls", "Tool calls without an outcome")
        self.waiting = gauge(
            "charlie_tasks_waiting_for_person",
            "Tasks with a call held for a person, by what it needs (approval, reply, reconcile)",
            ("kind",),
        )
        self.oldest_stalled = gauge(
            "charlie_oldest_stalled_run_seconds",
            "How long the oldest run that is due and not moving has not moved (0: none)",
        )
        self.queue_depth = gauge(
            "charlie_broker_queue_depth", "Messages waiting in a broker queue", ("queue",)
        )
        self.gauges_read_seconds = gauge(
            "charlie_gauges_read_seconds", "How long the last read of the fleet's gauges took"
        )

    # -- hooks ---------------------------------------------------------------------------

    def tick(self, scope: TickScope) -> _TickTimer:
        return _TickTimer(self, scope)

    def _ticked(self, scope: TickScope, seconds: float, raised: bool) -> None:
        phase = scope.phase.value
        result = "raised" if raised else scope.result
        self.ticks.labels(phase, result or "?").inc()
        if result not in _RAN:
            return
        self.phase_seconds.labels(phase).observe(seconds)
        if scope.to is not None and result in ("moved", "done"):
            self.transitions.labels(phase, scope.to.value).inc()
        if scope.model_repeats:
            self.model_repeats.inc(scope.model_repeats)
        for tool, outcome in scope.results:
            self.tool_calls.labels(self._tools(tool_label(tool)), outcome).inc()
        for spec, before, after in scope.compactions:
            model = self._models(model_label(spec))
            self.compactions.labels(model).inc()
            self.compacted_tokens.labels(model, "before").inc(before)
            self.compacted_tokens.labels(model, "after").inc(after)

    def model_call(self, event: ModelCallEvent) -> None:
        model = self._models(model_label(event.model))
        self.model_calls.labels(model, event.outcome).inc()
        self.model_seconds.labels(model).observe(max(0.0, event.ended - event.started))
        if event.outcome == "ok" and event.input_tokens:
            purpose = event.purpose if event.purpose in ("turn", "summary") else "turn"
            self.input_tokens.labels(model, purpose).observe(event.input_tokens)
        for kind, count in (
            ("input", event.input_tokens),
            ("output", event.output_tokens),
            ("reasoning", event.reasoning_tokens),
            ("cache_read", event.cache_read_tokens),
            ("cache_write", event.cache_write_tokens),
        ):
            if count:
                self.tokens.labels(model, kind).inc(count)
        cost = pricing.cost_usd(
            event.model,
            event.input_tokens,
            event.output_tokens,
            event.reasoning_tokens,
            self.prices,
            cache_read_tokens=event.cache_read_tokens,
            cache_write_tokens=event.cache_write_tokens,
        )
        if cost:
            self.cost.labels(model).inc(cost)

    def call_settled(self, event: CallEvent) -> None:
        tool = self._tools(tool_label(event.tool))
        if event.late:
            self.late_reports.labels(tool, event.outcome).inc()
        elif event.duration_ms is not None:
            self.tool_seconds.labels(tool).observe(max(0.0, event.duration_ms / 1000))

    def fused_commit(self, commit: str, applied: bool) -> None:
        self.fused_commits.labels(commit, "applied" if applied else "fell_back").inc()

    def model_limit(self, limit: str, event: str) -> None:
        self.model_limit_events.labels(limit, event).inc()

    def sweep(self, event: SweepEvent) -> None:
        self.sweep_actions.labels(event.sweep, event.action).inc(event.count)

    def gauges(self, read: Callable[[], dict[str, Any]]) -> None:
        now = time.monotonic()
        if now - self._gauges_read < self.gauge_seconds:
            return
        self._gauges_read = now
        found = read()
        self.gauges_read_seconds.set(time.monotonic() - now)
        runs = found.get("runs", {})
        for phase in Phase:
            if phase is not Phase.DONE:
                self.runs.labels(phase.value).set(runs.get(phase.value, 0))
        for status, count in found.get("tasks", {}).items():
            self.tasks.labels(status).set(count)
        if "open_tool_calls" in found:
            self.open_calls.set(found["open_tool_calls"])
        for kind, count in found.get("waiting_for_person", {}).items():
            self.waiting.labels(kind).set(count)
        if "oldest_stalled_run_seconds" in found:
            self.oldest_stalled.set(found["oldest_stalled_run_seconds"])
        for limit, (in_flight, waiting) in found.get("model_limits", {}).items():
            self.model_limit_in_flight.labels(limit).set(in_flight)
            self.model_limit_waiting.labels(limit).set(waiting)
        for queue, depth in found.get("queue_depth", {}).items():
            if depth is not None:  # a broker that cannot say leaves the last value
                self.queue_depth.labels(queue).set(depth)


class _TickTimer:
    """The tick hook as a plain context manager (cheaper than a generator's)."""

    __slots__ = ("observer", "scope", "started")

    def __init__(self, observer: MetricsObserver, scope: TickScope) -> None:
        self.observer = observer
        self.scope = scope
        self.started = 0.0

    def __enter__(self) -> TickScope:
        self.started = time.perf_counter()
        return self.scope

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        try:
            self.observer._ticked(self.scope, time.perf_counter() - self.started, kind is not None)
        except Exception:
            log.warning("metrics: tick hook raised; ignored", exc_info=True)


def _prices() -> pricing.PriceTable:
    """The price table of this process's settings; none (no cost counted) when it cannot be
    read, which the runs with a usd budget report themselves."""
    from charlie.config import settings

    try:
        return pricing.price_table(settings().prices)
    except Exception:
        log.warning("CHARLIE_PRICES cannot be read: charlie_cost_usd counts nothing", exc_info=True)
        return {}
