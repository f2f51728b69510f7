"""The ``charlie`` command."""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from charlie.config import settings
from charlie.domain import Channel, Origin
from charlie.terminal import printable

if TYPE_CHECKING:
    from celery import Celery

T = TypeVar("T")


def _say(line: str, *, err: bool = False, multiline: bool = False) -> None:
    """Print one line (or, ``multiline``, a body of lines) with every control and format
    character shown rather than obeyed: what the command prints carries task ids, models,
    results, questions, tool names and errors that a model, a tool or an MCP server wrote, and
    a terminal must not act on any of it (the operator reads what is there)."""
    click.echo(printable(line, multiline=multiline), err=err)


def _fail(message: str) -> None:
    _say(f"charlie: {message}", err=True, multiline=True)
    sys.exit(2)


def _fmt_time(value: datetime | None) -> str:
    return value.strftime("%H:%M:%S.%f")[:-3] if value else "-"


def _short(value: Any, limit: int = 100) -> str:
    """One line of at most ``limit`` characters: controls shown (before whitespace is folded,
    so a CR or a line separator is seen, not turned into a space), runs of whitespace folded."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = " ".join(printable(text, multiline=True).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _safe_database(url: str) -> str:
    """A database URL as it may be printed: without its password."""
    from charlie.store.probe import printable_url

    return printable_url(url)


def _celery_app() -> Celery:
    """The Celery app, once its broker transport is known to load: a missing transport
    dependency is one clear line and exit status 2, not a traceback from inside Celery."""
    from charlie.app import app
    from charlie.doctor import transport_problem

    try:
        problem = transport_problem(app)
    except ValueError as exc:  # a CHARLIE_* setting that does not parse
        _fail(str(exc))
    if problem:
        _fail(problem)
    return app


#: whether a command's unexpected error shows its traceback (``charlie --debug``, or
#: CHARLIE_DEBUG=1 in the environment)
_debug = False


class _Short(logging.Handler):
    """Where a command's log records go when nothing else is set up for them (Python's last
    resort): one line each, ``charlie: message (Error: its first line)``, not a traceback; with
    --debug, the traceback too. The long-running commands (worker, beat, ui) set up logging of
    their own and never reach it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                error = record.exc_info[1]
                first = (str(error).strip().splitlines() or [""])[0]
                text += f" ({type(error).__name__}: {first})" if first else ""
                if _debug:
                    text += "\n" + logging.Formatter().formatException(record.exc_info)
            _say(f"charlie: {text}", err=True, multiline=True)
        except Exception:
            self.handleError(record)


class _Main(click.Group):
    """Every command's errors said in one place: an infrastructure error (a database that
    refuses, one not migrated, a broker down, tool modules that do not import) is a line or
    two saying what, where and what to do, exit status 2; ``--debug`` raises it as it is."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Abort, click.exceptions.Exit):
            raise
        except Exception as exc:
            if _debug:
                raise
            from charlie.doctor import explain

            try:
                current = settings()
            except ValueError:
                current = None
            _fail(explain(exc, current))


@click.group(cls=_Main)
@click.version_option(package_name="charlie")
@click.option(
    "--debug",
    is_flag=True,
    envvar="CHARLIE_DEBUG",
    help="Show the traceback of an error instead of its one-line explanation (also "
    "CHARLIE_DEBUG=1).",
)
def main(debug: bool) -> None:
    """Charlie: durable agent tasks on Celery."""
    global _debug
    _debug = debug
    logging.lastResort = _Short()


#: `charlie worker`'s pool when its command line names none: a model call is seconds of waiting
#: on the provider, and a thread waits for a few dozen KiB where a prefork process costs tens of
#: MiB (docs/production/workers.md)
WORKER_POOL = "threads"
#: its concurrency then: the calls one process keeps in flight; the GIL is free while they wait,
#: and the ticks between them are milliseconds of CPU, so one core serves this many
WORKER_CONCURRENCY = 64


def worker_pool_argv(args: list[str]) -> list[str]:
    """What `charlie worker` adds to Celery's command line for the pool: threads and
    WORKER_CONCURRENCY unless ``args`` name a pool or a concurrency of their own (a named
    prefork or solo pool keeps the concurrency of 2 it always had, unless given)."""
    added: list[str] = []
    pool = None
    for i, a in enumerate(args):
        if a in ("-P", "--pool") and i + 1 < len(args):
            pool = args[i + 1]
        elif a.startswith("--pool="):
            pool = a.split("=", 1)[1]
        elif a.startswith("-P") and len(a) > 2:
            pool = a[2:]
    if pool is None:
        added += ["--pool", WORKER_POOL]
    if not any(
        a in ("-c", "--concurrency") or a.startswith(("--concurrency=", "-c")) for a in args
    ):
        many = pool in (None, "threads", "gevent", "eventlet")
        added += ["--concurrency", str(WORKER_CONCURRENCY if many else 2)]
    return added


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def worker(ctx: click.Context) -> None:
    """Run a Celery worker with Charlie's configuration (extra arguments go to Celery)."""
    app = _celery_app()
    args = list(ctx.args)
    argv = ["worker", "--loglevel", "INFO", *worker_pool_argv(args)]
    if not any(a in ("-Q", "--queues") or a.startswith("--queues=") for a in args):
        argv += ["--queues", ",".join(settings().worker_queues)]
    if settings().is_embedded_broker:
        # The embedded broker has no fanout between hosts worth gossiping over.
        argv += ["--without-gossip", "--without-mingle"]
    app.worker_main(argv + args)


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option(
    "-s",
    "--schedule",
    type=click.Path(path_type=Path),
    default=None,
    help="A file touched after every sweep round, for supervisors that check its age.",
)
@click.option(
    "-l",
    "--loglevel",
    default="INFO",
    show_default=True,
    help="Log level (DEBUG, INFO, WARNING, ...).",
)
@click.option(
    "--celery-beat",
    is_flag=True,
    help="Run Celery beat instead: the sweeps are queued to the workers (charlie.sweeps).",
)
@click.pass_context
def beat(ctx: click.Context, schedule: Path | None, loglevel: str, celery_beat: bool) -> None:
    """Run the recovery sweeps every CHARLIE_SWEEP_INTERVAL, in this process. Run one (two do
    no harm: every action is a compare-and-set)."""
    app = _celery_app()
    if celery_beat:
        extra = ["--schedule", str(schedule)] if schedule else []
        app.start(["beat", "--loglevel", loglevel, *extra, *ctx.args])
        return
    if ctx.args:
        _fail(f"unexpected arguments {' '.join(ctx.args)!r} (Celery's go with --celery-beat)")
    import signal
    import threading

    from charlie import logs, sweeps, telemetry
    from charlie.runtime import get_runtime
    from charlie.telemetry import metrics

    level = logging.getLevelName(loglevel.upper())
    if not isinstance(level, int):
        _fail(f"unknown log level {loglevel!r}")
    logging.basicConfig(level=level, format="[%(asctime)s: %(levelname)s/beat] %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)  # its schema check is not news
    logs.install(logging.getLogger(), json_lines=settings().log_format == "json")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # Metrics: the sweeps run here, so the fleet's gauges and the sweeps' counts are
    # served from here, on CHARLIE_BEAT_METRICS_PORT (else CHARLIE_METRICS_PORT + 1).
    try:
        server = telemetry.serve_metrics("beat")
    except telemetry.MetricsError as exc:
        _fail(str(exc))
        return
    environ = dict(os.environ)
    if server is not None:
        environ[metrics.PORT] = str(server.port)
    rt = get_runtime(mcp=False)
    telemetry.install(rt, environ)
    try:
        sweeps.run_beat(rt, stop, liveness=schedule)
    finally:
        telemetry.shutdown(rt)
        if server is not None:
            server.stop()


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option(
    "--basic-auth",
    envvar="FLOWER_BASIC_AUTH",
    default=None,
    help="user:password (or FLOWER_BASIC_AUTH); required unless --auth (OAuth) is given.",
)
@click.pass_context
def flower(ctx: click.Context, basic_auth: str | None) -> None:
    """Run Flower on Charlie's broker (extra arguments go to Flower). It refuses to start
    without authentication: it shows every task and can control workers."""
    from charlie import flowerconfig

    args = list(ctx.args)
    oauth = any(a == "--auth" or a.startswith("--auth=") for a in args)
    if not basic_auth and not oauth:
        _fail(
            "refusing to start Flower without authentication: give --basic-auth user:password "
            "(or FLOWER_BASIC_AUTH), or --auth with Flower's OAuth settings"
        )
    if basic_auth and ":" not in basic_auth:
        _fail("--basic-auth takes user:password")
    app = _celery_app()
    extra = [f"--basic-auth={basic_auth}"] if basic_auth else []
    app.start(["flower", f"--conf={flowerconfig.__file__}", *extra, *args])


def _budget_options(command: Any) -> Any:
    """--budget-tokens, --budget-usd, --budget-model-calls."""
    for name, kind, what in reversed(
        (
            ("--budget-tokens", int, "tokens (input + output)"),
            ("--budget-usd", float, "USD, by the price table CHARLIE_PRICES"),
            ("--budget-model-calls", int, "model calls"),
        )
    ):
        command = click.option(
            name,
            type=kind,
            default=None,
            help=f"Fail the task rather than call its model past this many {what}.",
        )(command)
    return command


def _budget(tokens: int | None, usd: float | None, calls: int | None) -> dict[str, Any] | None:
    given = {"tokens": tokens, "usd": usd, "model_calls": calls}
    return {k: v for k, v in given.items() if v is not None} or None


def _usage_limits(given: tuple[str, ...]) -> dict[str, int] | None:
    """``--usage-limit request_limit=20`` as the dict an agent task's usage_limits takes."""
    limits: dict[str, int] = {}
    for pair in given:
        name, sep, value = pair.partition("=")
        if not sep or not value.strip().isdigit():
            _fail(f"--usage-limit takes NAME=N (e.g. request_limit=20), got {pair!r}")
        limits[name.strip()] = int(value)
    return limits or None


@main.command()
@click.argument("prompt")
@click.option("--model", "-m", default=None, help="scripted:PATH, openai:NAME, ...")
@click.option(
    "--tool",
    "tools",
    multiple=True,
    help="A tool the model may use (repeatable). Left out, the model may use every tool the "
    "workers offer: the built-ins (read_file, write_file, list_files, run_command, recall, "
    "ask_human, delegate, wait_for_task), CHARLIE_TOOL_MODULES' and the MCP servers' "
    "(`charlie tools` lists them).",
)
@click.option(
    "--agent", default=None, help="A Pydantic AI agent (module:attr) to run instead of --model."
)
@click.option("--deps", default=None, help="module:function that builds the agent's deps.")
@click.option(
    "--usage-limit",
    "usage_limits",
    multiple=True,
    help="An agent's Pydantic AI usage limit, NAME=N, e.g. request_limit=20 (repeatable).",
)
@click.option("--task-id", default=None, help="Your own id; submitting it again is a no-op.")
@click.option("--timeout", type=float, default=None, help="Seconds before the task times out.")
@click.option(
    "--workspace",
    default=None,
    help="Directory the task's tools work in (inside CHARLIE_WORKSPACE_ROOTS).",
)
@click.option(
    "--approve",
    "approve",
    multiple=True,
    help="A tool whose calls wait for `charlie approve` before they run (repeatable).",
)
@_budget_options
@click.option(
    "--priority",
    type=int,
    default=0,
    show_default=True,
    help="Higher goes first among model calls waiting for a provider limit (CHARLIE_MODEL_LIMITS).",
)
@click.option("--wait", "wait_", is_flag=True, help="Wait and print the final status.")
def submit(
    prompt: str,
    model: str | None,
    tools: tuple[str, ...],
    agent: str | None,
    deps: str | None,
    usage_limits: tuple[str, ...],
    task_id: str | None,
    timeout: float | None,
    workspace: str | None,
    approve: tuple[str, ...],
    budget_tokens: int | None,
    budget_usd: float | None,
    budget_model_calls: int | None,
    priority: int,
    wait_: bool,
) -> None:
    """Submit a task and print its id."""
    from charlie import api
    from charlie.runtime import import_tool_modules

    try:
        # what a worker imports before it takes any task: a module that cannot be imported
        # here is said now, not accepted into a task no worker can start
        import_tool_modules(settings().tool_modules)
    except ImportError as exc:
        _fail(f"{exc}; fix CHARLIE_TOOL_MODULES (workers refuse to start with it)")

    # absolute here: the worker's working directory is not this one
    metadata = {"workspace": os.path.abspath(workspace)} if workspace else None
    if agent is not None and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # an agent's module is found as `python -m` finds it
    try:
        tid = api.submit(
            prompt,
            model=model,
            tools=list(tools) or None,
            task_id=task_id,
            timeout=timeout,
            metadata=metadata,
            approve=list(approve) or None,
            budget=_budget(budget_tokens, budget_usd, budget_model_calls),
            priority=priority,
            agent=agent,
            deps=deps,
            usage_limits=_usage_limits(usage_limits),
        )
    except (ValueError, ImportError) as exc:  # ImportError: a CHARLIE_TOOL_MODULES module
        _fail(str(exc))
    _say(tid)
    if wait_:
        info = api.wait(tid, timeout=timeout or 3600)
        _say(f"{info.status.value}: {_short(info.result or info.error, 2000)}")
        sys.exit(0 if info.status.value == "succeeded" else 1)


@main.command()
@click.argument("task_id")
@click.option("--timeout", type=float, default=3600.0, help="Seconds to wait at most.")
def wait(task_id: str, timeout: float) -> None:
    """Wait for a task to end; print its status and result. Exit 0 only if it succeeded.

    A task not created yet is waited for too: a producer's `charlie.submit` may still be
    crossing the broker."""
    import time

    from charlie import api
    from charlie.scheduler import TaskNotFound

    deadline = time.monotonic() + timeout
    while True:
        try:
            info = api.wait(task_id, timeout=max(0.0, deadline - time.monotonic()))
            break
        except TaskNotFound as exc:
            if time.monotonic() >= deadline:
                _fail(f"{exc} after {timeout:g} s")
            time.sleep(0.5)
        except TimeoutError as exc:
            _say(f"charlie: {exc}", err=True)
            sys.exit(1)
    _say(f"{info.status.value}: {_short(info.result or info.error, 2000)}")
    sys.exit(0 if info.status.value == "succeeded" else 1)


@main.command()
@click.argument("task_id")
@click.option("--after", default=None, help="Resume after this offset (an event's offset).")
@click.option("--offsets", is_flag=True, help="Print each event's offset before it.")
@click.option(
    "--timeout",
    type=float,
    default=None,
    help="Stop following after this long (and wait this long at most, 3600 s when not given, "
    "for a task not created yet).",
)
@click.option(
    "--until-waiting",
    is_flag=True,
    help="Stop, exit 0, once the task waits for a person (an approval, a reply).",
)
def watch(
    task_id: str, after: str | None, offsets: bool, timeout: float | None, until_waiting: bool
) -> None:
    """Follow a task live: the model's text as it is written, tool calls as they start and
    settle, waits for people, the end. Exits as `charlie wait` does: 0 only if it succeeded.

    A task not created yet is waited for, as `charlie wait` does. What streams is a watcher's
    view, never the record (a model call cut mid-way and asked again streams again); the
    answer is the task's result."""
    import time

    from charlie import api
    from charlie.scheduler import TaskNotFound

    started = time.monotonic()
    _await_task(task_id, WAIT_FOR_TASK if timeout is None else timeout)
    left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
    view = _Watch(offsets)
    try:
        for event in api.events(task_id, after=after, timeout=left):
            view.show(event)
            if until_waiting and event.type == "waiting":
                sys.exit(0)
    except TaskNotFound as exc:
        _fail(str(exc))
    except (api.StreamUnavailable, ValueError) as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        view.line("")
        sys.exit(130)
    if view.status is None:  # --timeout passed first
        view.line("charlie: still running; watch again with --after " + (view.offset or ""))
        sys.exit(1)
    sys.exit(0 if view.status == "succeeded" else 1)


#: how long `charlie watch` without --timeout waits for a task to be created
WAIT_FOR_TASK = 3600.0


def _await_task(task_id: str, timeout: float) -> None:
    """Return once the task exists: a producer's `charlie.submit` may still be crossing the
    broker. Exits 2 with the reason after ``timeout`` seconds."""
    import time

    from charlie import api
    from charlie.scheduler import TaskNotFound

    deadline = time.monotonic() + timeout
    said = False
    while True:
        try:
            api.get_task(task_id)
            return
        except TaskNotFound as exc:
            if time.monotonic() >= deadline:
                _fail(f"{exc}: it was not created within {timeout:g} s")
            if not said:
                waiting = f"charlie: no task {task_id} yet; waiting up to {timeout:g} s for it"
                _say(waiting, err=True)
                said = True
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


class _Watch:
    """Prints a run's events: Charlie's own lines as they are, everything a model, a tool or a
    person wrote made printable (controls shown, never obeyed); the model's text indented
    under the line that says which call wrote it, so it can never pass for one of Charlie's."""

    GUTTER = "  │ "

    def __init__(self, offsets: bool) -> None:
        self.offsets = offsets
        self.inline: str | None = None  # what the current unfinished line streams
        self.status: str | None = None
        self.offset: str | None = None

    def line(self, text: str) -> None:
        if self.inline is not None:
            click.echo("")
            self.inline = None
        click.echo(text)

    def stream(self, what: str, label: str, text: str) -> None:
        if self.inline != what:
            self.line(label)
            click.echo(self.GUTTER, nl=False)
            self.inline = what
        body = printable(text, multiline=True).replace("\n", "\n" + self.GUTTER)
        click.echo(body, nl=False)
        sys.stdout.flush()

    def show(self, event: Any) -> None:
        data, kind = event.data, event.type
        self.offset = event.offset
        if self.offsets and kind not in ("text", "reasoning", "tool_args"):
            self.line(f"@{event.offset}")
        call = _short(data.get("call"), 40)
        if kind == "model_start":
            attempt = data.get("attempt")
            again = f", attempt {_short(attempt, 10)}" if attempt and attempt != 1 else ""
            model = _short(data.get("model"))
            turn = _short(data.get("turn"), 10)
            self.line(f"turn {turn}: model {model} writes (call {call}{again})")
        elif kind == "text":
            self.stream(f"text {call}", "  text:", str(data.get("text", "")))
        elif kind == "reasoning":
            self.stream(f"reasoning {call}", "  reasoning:", str(data.get("text", "")))
        elif kind == "tool_args":
            name = _short(data.get("name") or "?", 60)
            cid = _short(data.get("call_id"), 60)
            self.stream(f"args {call} {cid}", f"  arguments of {name} ({cid}):", str(data["text"]))
        elif kind == "model_restart":
            self.line(f"  stream cut, asked again: {_short(data.get('reason'), 300)}")
        elif kind == "model_end":
            status = _short(data.get("status"), 20)
            reason = f": {_short(data.get('reason'), 300)}" if data.get("reason") else ""
            self.line(f"  model call {call} {status}{reason}")
        elif kind == "tool_call":
            held = f" (held for {_short(data['held'], 20)})" if data.get("held") else ""
            name, arguments = _short(data.get("name"), 60), _short(data.get("arguments"), 300)
            self.line(f"tool call {_short(data.get('call_id'), 60)}: {name}({arguments}){held}")
        elif kind == "tool_started":
            self.line(f"  started {_short(data.get('call_id'), 60)}")
        elif kind in ("tool_settled", "tool_late_report"):
            what = "settled" if kind == "tool_settled" else "late report of"
            cid, name = _short(data.get("call_id"), 60), _short(data.get("name"), 60)
            self.line(f"  {what} {cid} {name}: {_short(data.get('outcome'), 30)}")
        elif kind == "waiting":
            for held in data.get("calls") or []:
                what = (
                    f"a reply to {_short(held.get('question'), 300)}"
                    if held.get("hold") == "reply"
                    else f"an approval of {_short(held.get('name'), 60)}"
                )
                self.line(f"waiting for a person: {what} (call {_short(held.get('call_id'), 60)})")
        elif kind == "verdict":
            cid, by = _short(data.get("call_id"), 60), _short(data.get("by"), 100)
            self.line(f"  {_short(data.get('action'), 20)} of {cid} by {by}")
        elif kind == "retrying":
            self.line(_retrying_line(data))
        elif kind == "final":
            self.line("final answer recorded")
        elif kind == "truncated":
            self.line("  (the stream was full: text after this was dropped)")
        elif kind == "resumed":
            self.line("ended, then resumed: following it on")
        elif kind == "end":
            self.status = str(data.get("status"))
            from charlie import api

            info = api.get_task(str(data.get("task_id")))
            self.line(f"{info.status.value}: {_short(info.result or info.error, 2000)}")


def _retrying_line(data: dict[str, Any]) -> str:
    """A model call that failed and is asked again later (I36): when, and until when."""

    def clock(value: Any) -> str:
        try:
            return datetime.fromisoformat(str(value)).astimezone(UTC).strftime("%H:%M:%S UTC")
        except ValueError:
            return _short(value, 40)

    from charlie.models.retrying import attempts_failed

    # the run's count, as status, list, the console and doctor say it (I36)
    count = data.get("attempts")
    failed = (
        attempts_failed(count) if isinstance(count, int) else f"{_short(count, 10)} attempts failed"
    )
    return (
        f"  retrying the model call: {failed}; next attempt at "
        f"{clock(data.get('next_at'))}, gives up at {clock(data.get('until'))}; last error: "
        f"{_short(data.get('error'), 300)}"
    )


@main.command()
@click.option("--timeout", type=float, default=3.0, help="Seconds each check may take.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def doctor(timeout: float, as_json: bool) -> None:
    """Check this machine's view of the deployment: database, schema, broker, tools, devbox,
    beat, workers and database connections. Exit 0 only when no check fails (a WARN does
    not)."""
    from charlie import doctor as checks

    results, code = checks.diagnose(timeout=timeout)
    if as_json:
        _say(json.dumps(checks.as_json(results), indent=2), multiline=True)
    else:
        for check in results:
            _say(check.line())
        failed = sum(c.failed for c in results)
        warned = sum(c.status == "WARN" for c in results)
        summary = "all checks passed" if not failed else f"{failed} check(s) failed"
        _say(summary + (f", {warned} warning(s)" if warned else ""))
    sys.exit(code)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def tools(as_json: bool) -> None:
    """List every tool a worker with this environment offers: the built-ins, the user tools of
    CHARLIE_TOOL_MODULES and the tools of the MCP servers of CHARLIE_MCP_CONFIG /
    CHARLIE_MCP_SERVERS (listed now), with each one's effect, approval, resumability, what an
    interruption does, whether its calls may run at once in one worker, and where it comes
    from."""
    from charlie.runtime import import_tool_modules
    from charlie.tools.registry import REGISTRY

    s = settings()
    try:
        import_tool_modules(s.tool_modules)
    except ImportError as exc:
        _fail(str(exc))
    servers: list[dict[str, Any]] = []
    if s.mcp_config or s.mcp_servers:
        from charlie import mcp

        try:
            found = mcp.discover(s, REGISTRY)
        except mcp.McpConfigError as exc:
            _fail(str(exc))
        servers = [
            {"name": n, "server": st.described, "tools": len(st.tools), "problem": st.problem}
            for n, st in found.items()
        ]
    rows = [
        {
            "name": d.name,
            "effect": d.effect.value,
            "approval": d.approval,
            "resumable": "yes" if d.resumable else "once parked" if d.parks else "no",
            "on_interrupt": d.on_interrupt.value,
            "deadline": d.deadline,
            "threadsafe": d.threadsafe,
            "source": d.source or "user",
            "implementation": d.implementation,
        }
        for d in REGISTRY.enabled(None)
    ]
    if as_json:
        _say(json.dumps({"tools": rows, "mcp_servers": servers}, indent=2), multiline=True)
        return
    # a user module's or an MCP server's tool name is shown, not obeyed, before it is padded
    for r in rows:
        r["name"] = printable(str(r["name"]))
    width = max((len(str(r["name"])) for r in rows), default=4)
    _say(
        f"{'NAME':<{width}}  {'EFFECT':<6}  {'APPROVAL':<8}  {'RESUMABLE':<11}  "
        f"{'INTERRUPT':<9}  {'AT ONCE':<7}  SOURCE"
    )
    for r in rows:
        _say(
            f"{r['name']:<{width}}  {r['effect']:<6}  {'yes' if r['approval'] else 'no':<8}  "
            f"{r['resumable']:<11}  {r['on_interrupt']:<9}  "
            f"{'yes' if r['threadsafe'] else 'no':<7}  {r['source']}"
        )
    for server in servers:
        state = f"{server['tools']} tools" if not server["problem"] else server["problem"]
        _say(f"mcp server {server['name']} ({server['server']}): {state}")


@main.command(name="list")
@click.option(
    "--status", "statuses", multiple=True, help="Only tasks with this status (repeatable)."
)
@click.option("--parent", default=None, help="Only the children of this task.")
@click.option(
    "--limit", type=int, default=50, show_default=True, help="At most this many (1-1000)."
)
@click.option("--before", default=None, help="The page after the one that ended with this id.")
@click.option(
    "--search",
    default=None,
    help="Only tasks whose id or prompt contains this text (case-insensitive), as the API's "
    "list_tasks(search=) and the console's search box.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_(
    statuses: tuple[str, ...],
    parent: str | None,
    limit: int,
    before: str | None,
    search: str | None,
    as_json: bool,
) -> None:
    """List tasks, newest first."""
    from charlie import api
    from charlie.scheduler import TaskNotFound

    try:
        page = api.list_tasks(
            status=list(statuses) or None,
            parent=parent,
            limit=limit,
            before=before,
            search=search,
        )
    except (ValueError, TaskNotFound) as exc:
        _fail(str(exc))
    if as_json:
        _say(json.dumps([asdict(t) for t in page], default=str, indent=2), multiline=True)
        return
    now = datetime.now(UTC)
    _say(f"{'TASK':<36}  {'STATUS':<9}  {'PHASE':<15}  {'TURN':>4}  {'AGE':>6}  MODEL")
    for t in page:
        phase = t.phase.value if t.phase else "-"
        age = _age((now - t.created_at).total_seconds())
        # a run retrying its model call says so in its row (I36): `charlie status` says more
        marker = f"  [retrying: {t.retrying.attempts} failed]" if t.retrying else ""
        _say(
            f"{_short(t.id, 36):<36}  {t.status.value:<9}  {phase:<15}  {t.turn:>4}  "
            f"{age:>6}  {_short(t.model, 40)}{marker}"
        )
    if len(page) == limit:
        filters = "".join(f" --status {s}" for s in statuses)
        filters += f" --parent {parent}" if parent else ""
        filters += f" --search {shlex.quote(search)}" if search else ""
        filters += f" --limit {limit}" if limit != 50 else ""
        _say(f"more: charlie list{filters} --before {page[-1].id}", err=True)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


@main.command()
@click.argument("task_id")
def status(task_id: str) -> None:
    """Show a task's status, result, usage, cost and budget."""
    from charlie import api, views
    from charlie.scheduler import TaskNotFound

    try:
        info = api.get_task(task_id)
    except TaskNotFound as exc:
        _fail(str(exc))
    rows = [
        ("task", info.id),
        ("status", info.status.value),
        ("phase", info.phase.value if info.phase else "-"),
        ("turn", str(info.turn)),
        ("model", info.model),
        ("parent", info.parent_id or "-"),
        ("created", str(info.created_at)),
        ("started", str(info.started_at or "-")),
        ("finished", str(info.finished_at or "-")),
        ("model calls", f"{info.model_calls} ({info.model_repeats} repeated after a crash)"),
        ("tokens", views.tokens_text(info.usage)),
        ("cost", views.usd(info.cost_usd)),
        ("budget", views.budget_text(info)),
        ("result", _short(info.result, 400) if info.result is not None else "-"),
        ("error", _short(info.error, 400) if info.error is not None else "-"),
    ]
    rows += [("waiting for", _short(w.describe(), 200)) for w in info.waiting_for]
    if info.capacity:
        rows.append(("waiting", info.capacity))
    if info.retrying:
        rows.append(("retrying", _short(info.retrying.describe(datetime.now(UTC)), 600)))
    for key, value in rows:
        _say(f"{key:>12}  {value}")


@main.command()
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def show(task_id: str, as_json: bool) -> None:
    """Show a task's transcript: each tool call with its result, outcome and timings."""
    from charlie import api
    from charlie.scheduler import TaskNotFound
    from charlie.views import tokens_text, transcript_rows

    try:
        if as_json:
            doc = {
                "task": asdict(api.get_task(task_id)),
                "transcript": [e.__dict__ for e in api.transcript(task_id)],
                "calls": [c.__dict__ for c in api.calls(task_id)],
                "transitions": api.history(task_id),
                "actions": [asdict(a) for a in api.actions(task_id)],
            }
            _say(json.dumps(doc, default=str, indent=2), multiline=True)
            return
        info = api.get_task(task_id)
        lines = [line for _, line in transcript_rows(task_id)]
        done = api.actions(task_id)
    except TaskNotFound as exc:
        _fail(str(exc))
    _say(f"task {info.id}: {info.status.value} (phase {info.phase}, turn {info.turn})")
    for line in lines:
        _say(line, multiline=True)  # a final answer's own lines stay lines, indented (views)
    for waiting in info.waiting_for:
        _say(f"waiting for {_short(waiting.describe(), 300)}")
    if done:
        _say("actions:")
    for action in done:
        # who, and how that is known: signed in to the console, or a claimed name (I32)
        what = f"  {_fmt_time(action.at)}  {action.action.value:<9} by {action.by}"
        what += f"  call {action.call_id}" if action.call_id else ""
        what += f"  {_short(action.detail, 160)}" if action.detail else ""
        what += f"  note: {_short(action.note, 160)}" if action.note else ""
        _say(what)
    _say(f"tokens: {tokens_text(info.usage)}; model calls {info.model_calls}")


@main.command()
@click.argument("task_id")
@click.option("--note", default=None, help="Why, for the record.")
def cancel(task_id: str, note: str | None) -> None:
    """Cancel a task (and its children)."""
    from charlie import api

    changed = _act(lambda: api.cancel(task_id, note=note, origin=_CLI))
    _say("canceled" if changed else "already finished")


#: how the CLI's actions are recorded: by the command line, under a claimed name (the
#: operator's --operator, CHARLIE_OPERATOR or OS user: nothing here proves it, I32)
_CLI = Origin(Channel.CLI, authenticated=False)


def _act(action: Callable[[], T]) -> T:
    """Run an operator action; a refusal (a second verdict, a finished task, a missing call)
    is one line and exit status 2."""
    from charlie.people import ActionRefused
    from charlie.scheduler import TaskConflict, TaskNotFound

    try:
        return action()
    except (ActionRefused, TaskNotFound, TaskConflict, ValueError) as exc:
        _fail(str(exc))
        raise  # unreachable: _fail exits


def _said(record: Any) -> None:
    detail = f": {_short(record.detail, 300)}" if record.detail else ""
    _say(f"{record.describe()}{detail}")


@main.command()
@click.argument("task_id")
@click.argument("text")
@click.option("--message-id", default=None, help="Idempotency key: the same id sends once.")
def send(task_id: str, text: str, message_id: str | None) -> None:
    """Send a message to a running task; it enters at the next turn boundary (I22)."""
    from charlie import api

    _say(_act(lambda: api.send(task_id, text, message_id=message_id, origin=_CLI)))


@main.command()
@click.argument("task_id")
@click.argument("call_id")
@click.argument("text")
def reply(task_id: str, call_id: str, text: str) -> None:
    """Answer a task's question (an ask_human call)."""
    from charlie import api

    record = _act(lambda: api.reply(task_id, call_id, text, origin=_CLI))
    _said(record)
    if (record.detail or {}).get("late"):
        _say("the question had already settled: recorded as a late report", err=True)


@main.command()
@click.argument("task_id")
@click.argument("call_id")
@click.option("--note", default=None, help="Why, for the record.")
def approve(task_id: str, call_id: str, note: str | None) -> None:
    """Approve a call held for approval: it is dispatched now."""
    from charlie import api

    _said(_act(lambda: api.approve(task_id, call_id, note=note, origin=_CLI)))


@main.command()
@click.argument("task_id")
@click.argument("call_id")
@click.option("--reason", required=True, help="Why; the model is shown it.")
def deny(task_id: str, call_id: str, reason: str) -> None:
    """Deny a call held for approval: it never runs; the model sees `denied` and the reason."""
    from charlie import api

    _said(_act(lambda: api.deny(task_id, call_id, reason, origin=_CLI)))


@main.command(name="reconcile")
@click.argument("task_id")
@click.argument("call_id")
@click.option("--done", is_flag=True, help="It happened.")
@click.option("--not-done", is_flag=True, help="It did not: run it again.")
@click.option("--unknown", is_flag=True, help="Nobody can tell.")
@click.option("--result", "result_json", default=None, help="With --done: its result, as JSON.")
@click.option("--note", default=None, help="Why, for the record.")
def reconcile_(
    task_id: str,
    call_id: str,
    done: bool,
    not_done: bool,
    unknown: bool,
    result_json: str | None,
    note: str | None,
) -> None:
    """Decide an interrupted call held for an operator: --done, --not-done or --unknown."""
    from charlie import api

    # One verdict: a shared flag would let the last of two silently win, and --not-done runs
    # the write again (I23, I24).
    given = [v for v, on in (("done", done), ("not_done", not_done), ("unknown", unknown)) if on]
    if len(given) > 1:
        flags = " and ".join("--" + v.replace("_", "-") for v in given)
        _fail(f"{flags}: give one verdict: --done [--result JSON], --not-done or --unknown")
    if not given:
        _fail("say what happened: --done [--result JSON], --not-done or --unknown")
    verdict = given[0]
    if result_json is not None and verdict != "done":
        _fail("--result goes with --done only")
    result = None
    if result_json is not None:
        try:
            result = json.loads(result_json)
        except ValueError as exc:
            _fail(f"--result is not JSON: {exc}")
    _said(
        _act(
            lambda: api.reconcile(task_id, call_id, verdict, result=result, note=note, origin=_CLI)
        )
    )


@main.command()
@click.argument("task_id")
@click.option("--timeout", type=float, default=None, help="Seconds from now before it times out.")
@click.option("--note", default=None, help="Why, for the record.")
@_budget_options
def resume(
    task_id: str,
    timeout: float | None,
    note: str | None,
    budget_tokens: int | None,
    budget_usd: float | None,
    budget_model_calls: int | None,
) -> None:
    """Resume a failed or timed-out task where it ended, with a fresh attempt budget.

    A --budget-* option sets that limit of the task's budget (the others stay): a task that
    failed by its budget resumes only with room in it."""
    from charlie import api

    budget = _budget(budget_tokens, budget_usd, budget_model_calls)
    _said(_act(lambda: api.resume(task_id, timeout=timeout, note=note, budget=budget, origin=_CLI)))


@main.command()
@click.argument("task_id")
@click.option(
    "--turn",
    type=int,
    required=True,
    help="Copy the history through this turn (turns count from 0, as `charlie show` prints them).",
)
@click.option("--message", default=None, help="User input for the fork's first model call.")
@click.option("--model", default=None, help="Another model for the fork.")
@click.option("--task-id", "new_id", default=None, help="The fork's id (default: generated).")
def fork(
    task_id: str, turn: int, message: str | None, model: str | None, new_id: str | None
) -> None:
    """Fork a task from the end of one of its turns: a new task that repeats nothing (I26)."""
    from charlie import api

    _say(
        _act(
            lambda: api.fork(
                task_id, turn=turn, message=message, model=model, task_id=new_id, origin=_CLI
            )
        )
    )


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=int, default=8484, show_default=True, help="Port to listen on (0: any free one)."
)
@click.option(
    "--token",
    envvar="CHARLIE_UI_TOKEN",
    default=None,
    help="The token every request needs: better CHARLIE_UI_TOKEN or --token-file, as every "
    "user of this machine sees a command line (ps); none of them: one is generated.",
)
@click.option(
    "--token-file",
    envvar="CHARLIE_UI_TOKEN_FILE",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Read the token from this file's first line (or CHARLIE_UI_TOKEN_FILE); keep it 0600.",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    help="Also answer requests for this Host, NAME:PORT or NAME on any port (repeatable; or "
    "CHARLIE_UI_ALLOWED_HOSTS, comma-separated). Always: the listening address, localhost, "
    "127.0.0.1 and [::1] with the port.",
)
@click.option(
    "--behind-tls-proxy",
    envvar="CHARLIE_UI_BEHIND_TLS_PROXY",
    is_flag=True,
    default=False,
    help="Browsers reach the console over HTTPS through a proxy (or "
    "CHARLIE_UI_BEHIND_TLS_PROXY=1): every cookie is Secure.",
)
@click.option(
    "--operator",
    default=None,
    help="Who the console's actions are recorded as, after 'ui:' "
    "(default: CHARLIE_OPERATOR, else the OS user).",
)
@click.option("--task", "task_id", default=None, help="Print the address of this task's page.")
@click.option(
    "--log-level",
    envvar="CHARLIE_UI_LOG_LEVEL",
    default="WARNING",
    show_default=True,
    help="Log level, or CHARLIE_UI_LOG_LEVEL (INFO logs every request; the token and the "
    "sessions never are).",
)
@click.pass_context
def ui(
    ctx: click.Context,
    host: str,
    port: int,
    token: str | None,
    token_file: Path | None,
    allowed_hosts: tuple[str, ...],
    behind_tls_proxy: bool,
    operator: str | None,
    task_id: str | None,
    log_level: str,
) -> None:
    """Serve the run console: the tasks, each run's transcript, timeline and open calls, and
    the actions people take on them. Every request needs the token."""
    from click.core import ParameterSource

    from charlie import logs
    from charlie.console import guard, scrub
    from charlie.console.auth import check_token, new_token, read_token_file, write_token_file
    from charlie.console.server import ConsoleConfig, serve
    from charlie.people import actor_name
    from charlie.runtime import get_producer

    level = logging.getLevelName(log_level.upper())
    if not isinstance(level, int):
        _fail(f"unknown log level {log_level!r}")
    if token is not None and token_file is not None:
        _fail("the token is given twice (--token / CHARLIE_UI_TOKEN and --token-file): give one")
    if token is not None and ctx.get_parameter_source("token") is ParameterSource.COMMANDLINE:
        click.echo(
            "warning: --token is visible to every user of this machine (ps, /proc/*/cmdline); "
            "pass it in CHARLIE_UI_TOKEN or --token-file instead",
            err=True,
        )
    generated = token is None and token_file is None
    try:
        if token_file is not None:
            token, loose = read_token_file(token_file)
            if loose:
                click.echo(f"warning: {loose}", err=True)
        token = new_token() if token is None else check_token(token)
    except ValueError as exc:
        _fail(str(exc))
    assert token is not None
    extra_hosts = guard.parse_hosts(
        [*allowed_hosts, os.environ.get("CHARLIE_UI_ALLOWED_HOSTS", "")]
    )
    try:
        guard.AllowedHosts.build(host, 1, extra_hosts)
    except ValueError as exc:
        _fail(f"--allowed-host / CHARLIE_UI_ALLOWED_HOSTS: {exc}")
    # Log lines never carry the token or a session (charlie.console.scrub): the handlers log
    # requests redacted, and every record of this process passes the scrubber.
    logging.basicConfig(level=level, format="[%(asctime)s: %(levelname)s/console] %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    logs.install(logging.getLogger(), json_lines=settings().log_format == "json")
    scrub.install(scrub.Scrubber([token]))
    try:
        producer = get_producer()
        name = actor_name(operator, producer)
    except Exception as exc:  # the database cannot be reached or is not migrated
        _fail(f"cannot open the database: {exc}")
    operator_name = name if name.startswith("ui:") else f"ui:{name}"
    config = ConsoleConfig(
        token=token,
        operator=operator_name[:200],
        behind_tls_proxy=behind_tls_proxy,
        allowed_hosts=tuple(extra_hosts),
    )
    path = f"/tasks/{task_id}" if task_id else "/"
    shown = guard.address_name(host)

    def announce(bound: int) -> None:
        base = f"http://{shown}:{bound}{path}"
        _say(f"Charlie console on {host}:{bound}, acting as {config.operator}")
        _say(f"database {settings().database_url.split('://')[0]}; open:")
        if generated and sys.stdout.isatty():
            # The operator's own terminal, as Jupyter does: a generated token has no other way
            # to the person who started the console. Never a log record.
            _say(f"    {base}?token={token}")
        elif generated:
            # stdout is a pipe or a file: a service's journal or a container's log, which
            # others read and keep. The token goes to a file only this user can read.
            kept = settings().home / f"ui-token-{bound}"
            write_token_file(kept, token)
            _say(f"    {base}?token=<the token in {kept}>")
            _say(f"(a generated token; not printed, as stdout is not a terminal: see {kept})")
        else:
            _say(f"    {base}?token=<the token of CHARLIE_UI_TOKEN / --token-file>")
        answered = guard.AllowedHosts.build(host, bound, config.allowed_hosts)
        _say(f"answers to Host: {answered.describe()}")
        local = host in ("127.0.0.1", "::1", "localhost")
        if not local and not config.allowed_hosts:
            _say(
                "note: a request for any other Host is refused (DNS rebinding); allow the name "
                "other machines use with --allowed-host or CHARLIE_UI_ALLOWED_HOSTS",
                err=True,
            )
        if behind_tls_proxy:
            _say(
                "behind a TLS proxy: every cookie is Secure; open the console at the proxy's "
                "https address (its host name allowed with --allowed-host)"
            )
        elif not local:
            _say(
                "warning: serving plain HTTP beyond this machine; put TLS in front of it "
                "(and say so with --behind-tls-proxy), the token travels with every request",
                err=True,
            )
        sys.stdout.flush()

    try:
        serve(config, host, port, announce=announce)
    except OSError as exc:
        _fail(f"cannot listen on {host}:{port}: {exc}")


@main.group()
def db() -> None:
    """Database schema commands."""


@db.command()
def upgrade() -> None:
    """Apply Alembic migrations to CHARLIE_DATABASE_URL."""
    from charlie.home import prepare as prepare_home
    from charlie.store.engine import current_revision
    from charlie.store.engine import upgrade as do_upgrade

    s = settings()
    prepare_home(s.home)
    before = current_revision(s.database_url)
    do_upgrade(s.database_url)
    after = current_revision(s.database_url)
    where = _safe_database(s.database_url)
    if before == after:
        _say(f"{where}: already at revision {after}; nothing to do")
    else:
        _say(f"{where}: upgraded from revision {before or '(empty database)'} to {after}")


@main.command()
@click.option(
    "--timeout",
    type=float,
    default=120.0,
    show_default=True,
    help="Seconds the demo's task may run before it times out.",
)
@click.option(
    "--model",
    default=None,
    help="A real provider's model (openai:NAME, openai-responses:NAME, anthropic:NAME) instead "
    "of the demo's script; its key from OPENAI_API_KEY / ANTHROPIC_API_KEY (and base URL) or "
    "the CHARLIE_MODEL_ settings.",
)
def demo(timeout: float, model: str | None) -> None:
    """Run a whole agent task on this machine, no servers needed."""
    from charlie.demo.run import run_demo

    sys.exit(run_demo(timeout=timeout, model_spec=model))


@main.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def limits(ctx: click.Context, as_json: bool) -> None:
    """The provider limits (CHARLIE_MODEL_LIMITS): in flight, waiting, paused until."""
    if ctx.invoked_subcommand is not None:
        return
    from charlie.people import limit_actions, limit_states

    states = limit_states()
    actions = limit_actions(last=5)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "limits": [asdict(s) for s in states],
                    "actions": [
                        {**asdict(a), "by": a.by, "channel": a.channel.value} for a in actions
                    ],
                },
                default=str,
                indent=2,
            )
        )
        return
    if not states:
        _say("no provider limit has been used (CHARLIE_MODEL_LIMITS)")
    now = datetime.now(UTC)
    for state in states:
        _say(f"{state.key}: {state.describe(now)}")
    for action in actions:
        _say(
            f"  {action.at.isoformat(timespec='seconds')}  {action.action} {action.key} "
            f"by {action.by}" + (f"  note: {_short(action.note, 160)}" if action.note else "")
        )


@limits.command(name="resume")
@click.argument("key")
@click.option("--note", default=None, help="Why, for the record.")
def limits_resume(key: str, note: str | None) -> None:
    """Lift the pause a provider put on limit KEY: its callers send again at once."""
    from charlie.people import resume_limit

    record = _act(lambda: resume_limit(key, note=note, origin=_CLI))
    woken = (record.detail or {}).get("woken", 0) if isinstance(record.detail, dict) else 0
    paused = record.detail.get("paused_until") if isinstance(record.detail, dict) else None
    _say(f"lifted the pause of {key} (was until {paused}) by {record.by}; {woken} waiter(s) woken")


@main.command(name="export")
@click.argument("task_id")
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="The case file to write (JSON; '-' for standard output).",
)
@click.option(
    "--redact",
    "patterns",
    multiple=True,
    metavar="PATTERN",
    help="A regular expression whose matches are blanked in the case too (repeatable); "
    "use it for secrets only the workers' environment holds.",
)
def export_(task_id: str, output: Path, patterns: tuple[str, ...]) -> None:
    """Export a task's record (and its delegated children's) as a case file for
    `charlie replay`; secrets never go in (docs/replay.md).

    The secrets looked for by value are those of THIS process's environment (the exporter's),
    not the workers': a secret only the workers hold is blanked only if it has a known shape
    (a URL's password, a Bearer token, an sk-/ghp_ key, a field named like a secret) or a
    --redact pattern matches it."""
    from charlie.replay.export import export_task
    from charlie.scheduler import TaskNotFound

    try:
        case = export_task(task_id, redact=patterns)
    except (TaskNotFound, ValueError, ImportError) as exc:
        _fail(str(exc))
    text = json.dumps(case, indent=1, ensure_ascii=False, default=str) + "\n"
    if str(output) == "-":
        click.echo(text, nl=False)
        return
    try:
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)
    except OSError as exc:
        _fail(f"cannot write {output}: {exc.strerror}")
    redacted = case.get("redacted", {}).get("count", 0)
    _say(f"exported {task_id} to {output} ({redacted} secret value(s) blanked)")


@main.command(name="replay")
@click.argument("case")
@click.option(
    "--workspace",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="A directory the reads run in again, copied first (never used itself); an empty "
    "one by default.",
)
@click.option(
    "--run-writes",
    is_flag=True,
    help="Run the record's writes too, in the scratch copy of --workspace, never the original.",
)
@click.option("--json", "as_json", is_flag=True, help="The divergences as JSON.")
def replay_(case: str, workspace: Path | None, run_writes: bool, as_json: bool) -> None:
    """Replay an exported case (or a task, exported first) with today's code, in this
    process: exit 0 when nothing diverged, 1 when something did, 2 when it cannot be replayed."""
    from charlie.replay.case import CaseError, check_case, load_case
    from charlie.replay.engine import replay_case

    try:
        # a path (or what reads as one: a typo of one is not looked up as a task)
        if Path(case).exists() or case.endswith(".json") or os.sep in case:
            loaded = load_case(Path(case))
        else:
            from charlie.replay.export import export_task
            from charlie.scheduler import TaskNotFound

            try:
                loaded = check_case(export_task(case), case)
            except TaskNotFound:
                _fail(f"{case} is neither a case file nor a task id")
            except ImportError as exc:
                _fail(str(exc))
        report = replay_case(
            loaded, workspace=workspace, run_writes=run_writes, tools=_replay_tools()
        )
    except CaseError as exc:
        _fail(str(exc))
    if as_json:
        _say(json.dumps(report.as_dict(), default=str, indent=1), multiline=True)
    else:
        click.echo(report.render())  # (escaped by the report, line by line)
    sys.exit(report.exit_code)


def _replay_tools() -> Any:
    """The process's tools, with CHARLIE_TOOL_MODULES imported: today's code."""
    from charlie.runtime import import_tool_modules
    from charlie.tools.registry import REGISTRY

    try:
        import_tool_modules(settings().tool_modules)
    except ImportError as exc:
        _fail(str(exc))
    return REGISTRY


try:
    from charlie.devbox.cli import devbox as _devbox

    main.add_command(_devbox)
except ImportError:  # pragma: no cover - the devbox ships with the package
    pass
