"""`charlie doctor`: what an operator runs on any machine of a deployment to see what is wrong.

Each check answers ok or FAIL on one line, and a failure says what to do. Checks that depend on
an earlier one (the schema on the database, the workers on the broker) say so instead of
piling a second error on the first.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from charlie.config import TICK_QUEUE, Settings

if TYPE_CHECKING:
    from celery import Celery

    from charlie.store.types import Engine


@dataclass(frozen=True)
class Check:
    name: str
    #: "ok", "FAIL", "WARN" (works now, but may not: the exit status stays 0), or "skip" (not
    #: applicable here, or not checked because of an earlier FAIL).
    status: str
    detail: str
    #: what to do about a FAIL.
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"

    def line(self) -> str:
        text = f"{self.status:<4}  {self.name:<12}  {self.detail}"
        return f"{text} -> {self.fix}" if self.fix else text


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def _safe_url(url: str) -> str:
    """A URL as it may be printed: without its password."""
    from charlie.store.probe import printable_url

    return printable_url(url)


def transport_problem(app: Celery) -> str | None:
    """Why the broker's kombu transport cannot be loaded on this machine, or None.

    A transport whose dependencies are missing (kombu's Redis transport needs ``redis`` and
    ``packaging``) fails only when the worker first connects, with a traceback; this names the
    cause in one line before anything starts."""
    url = str(app.conf.broker_url or "")
    scheme = url.split(":", 1)[0] or "amqp"
    try:
        with app.connection_for_write() as conn:
            conn.transport  # noqa: B018  (resolving it imports the transport module)
    except ImportError as exc:
        return (
            f"the broker transport for {scheme}:// cannot be loaded: {_first_line(exc)}; "
            f"install what it needs (`pip install 'kombu[{scheme}]'`); a plain install of "
            "Charlie brings the Redis and RabbitMQ transports"
        )
    except Exception as exc:  # an unknown scheme, a malformed URL
        return f"the broker URL {_safe_url(url)!r} is not usable: {_first_line(exc)}"
    return None


def explain(exc: BaseException, settings: Settings | None = None) -> str:
    """What a command that failed on its infrastructure says instead of a traceback: what is
    wrong, where, and what to do, in a line or two (``charlie --debug`` shows the traceback).
    An error that is not the infrastructure's is named by its type and first line."""
    from charlie.store.engine import SchemaMissing
    from charlie.store.types import DatabaseError

    doctor = "`charlie doctor` checks the whole deployment"
    if isinstance(exc, SchemaMissing):
        text = str(exc).strip()
        return text if "charlie db upgrade" in text else f"{text}; run `charlie db upgrade`"
    if isinstance(exc, DatabaseError):
        where = _safe_url(settings.database_url) if settings else "CHARLIE_DATABASE_URL"
        cause = _first_line(getattr(exc, "orig", None) or exc)
        lowered = cause.lower()
        if ("does not exist" in lowered and "relation" in lowered) or "no such table" in lowered:
            return f"the database {where} has no Charlie schema ({cause}); run `charlie db upgrade`"
        if type(exc).__name__ in ("ArgumentError", "NoSuchModuleError"):
            return (
                f"CHARLIE_DATABASE_URL is not a database URL Charlie can use ({cause}); use "
                "postgresql://USER:PASSWORD@HOST:PORT/DB or sqlite:///PATH"
            )
        return (
            f"cannot reach the database {where}: {cause}; check CHARLIE_DATABASE_URL and that "
            f"the server is up ({doctor})"
        )
    if type(exc).__module__.split(".")[0] in ("kombu", "amqp", "redis", "celery"):
        where = _safe_url(settings.broker_url) if settings else "CHARLIE_BROKER_URL"
        return (
            f"cannot reach the broker {where}: {_first_line(exc)}; check CHARLIE_BROKER_URL "
            f"and that the broker is up ({doctor})"
        )
    if isinstance(exc, ImportError) and "CHARLIE_TOOL_MODULES" in str(exc):
        return f"{exc}; fix CHARLIE_TOOL_MODULES, or install the package that provides it"
    return (
        f"{_first_line(exc)} (an unexpected error: `charlie --debug ...` or CHARLIE_DEBUG=1 "
        "shows its traceback)"
    )


@dataclass
class Context:
    """What the checks share: the settings, how long each may take, and what an earlier check
    found that a later one builds on (a check that depends on an earlier one says "not
    checked" instead of piling a second error on the first)."""

    settings: Settings
    timeout: float
    #: the database's engine, once ``check_database`` connected (None: it could not)
    engine: Any = None
    #: the schema fits this code (``check_schema``)
    schema_ok: bool = False
    #: the schema is migrated, at whatever revision (its heartbeats can be read)
    schema_read: bool = False
    #: this process can sign its messages, or need not (``check_signing``)
    signing_ok: bool = True
    #: the sandbox runs commands here (``check_sandbox``)
    sandbox_ok: bool = False
    #: every heartbeat in the database, once read (None: it could not be).
    heartbeats: dict[str, Any] | None = None


#: one check's outcome: a line, several (one per MCP server), or none
Found = Check | list[Check] | None


# -- the database ------------------------------------------------------------------------------


def check_database(ctx: Context) -> Check:
    """The database answers (sets ``ctx.engine``)."""
    from charlie.store.probe import connect_once, sqlite_file

    s = ctx.settings
    url = s.database_url
    shown = _safe_url(url)
    if s.is_sqlite:
        path = sqlite_file(url)
        if path and not Path(path).exists():
            # connecting would create an empty file where the workers may not look
            return Check(
                "database",
                "FAIL",
                f"no database at {path} yet",
                "start `charlie worker` with this CHARLIE_HOME (it creates and migrates the "
                "embedded database), or run `charlie db upgrade`",
            )
    try:
        engine, version = connect_once(url, ctx.timeout)
    except ImportError as exc:
        return Check(
            "database",
            "FAIL",
            f"{shown}: its driver cannot be loaded ({_first_line(exc)})",
            "use postgresql+psycopg:// (psycopg 3), postgresql+psycopg2:// or sqlite:///PATH",
        )
    except Exception as exc:
        return Check(
            "database",
            "FAIL",
            f"cannot connect to {shown}: {_first_line(exc)}",
            "check CHARLIE_DATABASE_URL (host, port, user, database) and that the server is up",
        )
    ctx.engine = engine
    kind = "SQLite" if s.is_sqlite else "PostgreSQL"
    return Check("database", "ok", f"{shown} answers ({kind} {version}){_prepared(s, engine)}")


def _prepared(s: Settings, engine: Engine) -> str:
    """What a worker would do with its fused commits on this database (CHARLIE_DB_PREPARE)."""
    from charlie.store.engine import Prepare, prepares_fused_commits

    try:
        with engine.connect() as conn:
            prepared = prepares_fused_commits(conn, Prepare(s.db_prepare))
    except Exception as exc:
        return f"; whether it prepares statements is not known: {_first_line(exc)}"
    if prepared is None:
        return ""
    if prepared:
        return f"; a turn's commits are prepared on the server (CHARLIE_DB_PREPARE={s.db_prepare})"
    return f"; a turn's commits are not prepared (CHARLIE_DB_PREPARE={s.db_prepare}: " + (
        "off)" if s.db_prepare == "off" else "not a direct TCP connection to PostgreSQL)"
    )


def check_schema(ctx: Context) -> Check:
    """The schema fits this code (sets ``ctx.schema_ok`` and ``ctx.schema_read``)."""
    from charlie.store.revisions import SchemaFit, check_schema

    if ctx.engine is None:
        return Check("schema", "skip", "not checked: the database is unreachable")
    with ctx.engine.connect() as conn:
        fit = check_schema(conn)
    # Heartbeats (the beat's, waiting workers') are readable on any migrated schema.
    ctx.schema_read = fit.fit is not SchemaFit.NOT_MIGRATED
    if fit.can_claim:
        ctx.schema_ok = True
        if fit.fit is SchemaFit.CURRENT:
            return Check("schema", "ok", f"migrated to head ({fit.code})")
        return Check("schema", "ok", fit.why)
    fix = "run `charlie db upgrade` (once per release, from any machine)"
    if ctx.settings.is_sqlite:
        fix += "; a worker also migrates the embedded database when it starts"
    if fit.fit is SchemaFit.NOT_MIGRATED:
        return Check("schema", "FAIL", "not migrated: Charlie's tables are missing", fix)
    if fit.fit is SchemaFit.DATABASE_BEHIND:
        return Check(
            "schema",
            "FAIL",
            f"at revision {fit.database}, head is {fit.code}: workers of this code wait",
            fix,
        )
    return Check(
        "schema",
        "FAIL",
        f"at revision {fit.database}, whose floor {fit.floor} is newer than this code "
        f"({fit.code}): workers of this code claim no work",
        "upgrade Charlie on this machine (pip install -U charlie)",
    )


# -- the broker --------------------------------------------------------------------------------


def check_signing(ctx: Context) -> Check:
    """Celery's message signing (CHARLIE_SECURITY_*): off, said plainly; on, this process's
    key and certificate load, and its certificate is in its own store (a worker publishes its
    next ticks to workers that check against the same store). A FAIL sets
    ``ctx.signing_ok`` False."""
    s = ctx.settings
    if not s.signs_messages:
        return Check(
            "signing",
            "ok",
            "off: broker messages are not signed; anyone who can publish to the broker can "
            "submit and"
            + (
                " act by Celery message under a claimed name"
                if s.celery_operator_actions
                else " drive ticks (actions by Celery message are off)"
            ),
        )
    ctx.signing_ok = False
    try:
        from celery.security.certificate import Certificate, FSCertStore
        from celery.security.key import PrivateKey

        with open(str(s.security_key)) as f:
            password = s.security_key_password
            PrivateKey(f.read(), password=password.encode() if password else None)
        with open(str(s.security_certificate)) as f:
            cert = Certificate(f.read())
        store = FSCertStore(str(s.security_cert_store))
    except Exception as exc:
        return Check(
            "signing",
            "FAIL",
            f"cannot load the signing key, certificate or store: {_first_line(exc)}",
            "fix CHARLIE_SECURITY_KEY, CHARLIE_SECURITY_CERTIFICATE, "
            "CHARLIE_SECURITY_CERT_STORE (an RSA key in PEM, unexpired certificates)",
        )
    accepted = list(store.itercerts())
    try:
        store[cert.get_id()]
    except Exception:
        return Check(
            "signing",
            "FAIL",
            f"this process's certificate ({cert.get_issuer()}) is not in its store "
            f"({len(accepted)} certificate(s)): workers checking against it would refuse "
            "what this process publishes",
            "add the certificate to CHARLIE_SECURITY_CERT_STORE on every worker",
        )
    ctx.signing_ok = True
    return Check(
        "signing",
        "ok",
        f"messages signed as {cert.get_issuer()}; task messages taken only when signed "
        f"by one of {len(accepted)} certificate(s) in the store",
    )


def check_broker(ctx: Context) -> Check:
    """The broker answers, and its tick queue is declared as this process declares it."""
    from charlie.app import app

    if not ctx.signing_ok:
        return Check("broker", "skip", "not checked: this process cannot sign its messages")
    s = ctx.settings
    shown = _safe_url(s.broker_url)
    problem = transport_problem(app)
    if problem:
        return Check("broker", "FAIL", problem, "see docs/production/index.md")
    try:
        with app.connection_for_write(connect_timeout=ctx.timeout) as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, timeout=ctx.timeout)
            depth = conn.default_channel.queue_declare(queue=TICK_QUEUE, passive=True).message_count
    except Exception as exc:
        if "NOT_FOUND" in str(exc) or "404" in str(exc):
            depth = 0  # RabbitMQ: no worker has declared the queue yet
        else:
            return Check(
                "broker",
                "FAIL",
                f"cannot connect to {shown}: {_first_line(exc)}",
                "check CHARLIE_BROKER_URL and that the broker is up",
            )
    from charlie.runtime import tick_queue_problem

    mismatch = tick_queue_problem(app, s)
    if mismatch:
        return Check("broker", "FAIL", mismatch, "see docs/models/limits.md")
    return Check("broker", "ok", f"{shown} answers; {depth} message(s) wait in {TICK_QUEUE!r}")


def check_operator_actions(ctx: Context) -> Check | None:
    """Anyone who can publish to a broker reachable from elsewhere can act as an operator
    (actions by Celery message on, messages unsigned): a WARN naming both fixes (I32)."""
    return unsigned_broker_actions(ctx.settings)


def check_event_stream(ctx: Context) -> Check | None:
    """The RabbitMQ event stream queue held with other bounds than this process's settings
    give it: the workers use it as it is (charlie/streams/rabbitmq_stream.py); said so."""
    found = event_stream_check(ctx.settings)
    return None if found is None else Check(*found)


# -- what the workers import -------------------------------------------------------------------


def check_tools(ctx: Context) -> Check:
    """CHARLIE_TOOL_MODULES import and register their tools."""
    from charlie.runtime import import_tool_modules
    from charlie.tools.registry import REGISTRY

    modules = ctx.settings.tool_modules
    try:
        import_tool_modules(modules)
    except Exception as exc:
        return Check(
            "tools",
            "FAIL",
            str(exc) if isinstance(exc, ImportError) else _first_line(exc),
            "fix CHARLIE_TOOL_MODULES, or install the package that provides the module",
        )
    names = REGISTRY.names()
    shown = ", ".join(modules) or "built-ins only"
    return Check("tools", "ok", f"{len(names)} tools register ({shown}): {', '.join(names)}")


def check_model_limits(ctx: Context) -> Check | list[Check]:
    """CHARLIE_MODEL_LIMITS parsed, each limit shown, with what the fleet holds of it now (in
    flight, waiting, sent in the last minute, pauses the provider asked for)."""
    from charlie.limits import LimitsError, parse_limits

    try:
        table = parse_limits(ctx.settings.model_limits)
    except LimitsError as exc:
        return Check("model limits", "FAIL", str(exc), "fix CHARLIE_MODEL_LIMITS")
    if not table:
        return Check("model limits", "ok", "none declared (CHARLIE_MODEL_LIMITS): no call waits")
    held: dict[str, Any] = {}
    if ctx.engine is not None and ctx.schema_ok:
        from charlie.domain import utcnow
        from charlie.store import limits as store
        from charlie.store.engine import read

        with read(ctx.engine) as conn:
            held = {s.key: s for s in store.statuses(conn, utcnow())}
    parts = []
    for key, limit in sorted(table.items()):
        line = f"{key} {limit.describe()}"
        now = held.get(key)
        if now is not None:
            line += (
                f" (now {now.in_flight} in flight, {now.waiting} waiting, {now.recent} in "
                f"the last minute, {now.throttles} pause(s) asked by the provider)"
            )
        parts.append(line)
    return [
        Check("model limits", "ok", "; ".join(parts)),
        *paused_limits(held.values(), datetime.now(UTC)),
    ]


def check_model_retries(ctx: Context) -> Check:
    """Runs whose model call fails and is being retried (I36): how many, and the latest's
    last error, attempts and next attempt. A WARN: they may yet succeed, and each ends at
    CHARLIE_MODEL_RETRY_SECONDS at the latest."""
    from charlie.domain import utcnow
    from charlie.models import retrying
    from charlie.store.engine import read
    from charlie.store.reads import model_call_states

    name = "model calls"
    if ctx.engine is None or not ctx.schema_ok:
        return Check(name, "skip", "not checked: the database is unreachable or not migrated")
    try:
        with read(ctx.engine) as conn:
            rows = model_call_states(conn)
    except Exception as exc:
        return Check(name, "skip", f"not checked: {_first_line(exc)}")
    found = [(r.task_id, retrying.from_state(r.state)) for r in rows]
    failing = [(task_id, retry) for task_id, retry in found if retry is not None]
    if not failing:
        return Check(name, "ok", "no run is retrying a failed model call")
    task_id, first = failing[0]
    more = f" (and {len(failing) - 1} more)" if len(failing) > 1 else ""
    return Check(
        name,
        "WARN",
        f"{len(failing)} run(s) retrying a failed model call; task {task_id}{more}: "
        + first.describe(utcnow()),
        "check the model's provider, its URL and key (`charlie status TASK` shows the last "
        "error); a run gives up at CHARLIE_MODEL_RETRY_SECONDS",
    )


def check_mcp(ctx: Context) -> list[Check]:
    """One line per configured MCP server: it answers and lists its tools. The
    configuration's secrets never show: servers are described with their env and header
    values masked, and failures are scrubbed of them."""
    s = ctx.settings
    if not (s.mcp_config or s.mcp_servers):
        return [Check("mcp", "skip", "no MCP servers (CHARLIE_MCP_CONFIG, CHARLIE_MCP_SERVERS)")]
    from charlie import mcp
    from charlie.tools.registry import ToolRegistry

    try:
        found = mcp.discover(s, ToolRegistry(), timeout=max(ctx.timeout, 1.0))
    except mcp.McpConfigError as exc:
        return [Check("mcp", "FAIL", str(exc), "fix the MCP configuration at the key it names")]
    if not found:
        return [Check("mcp", "skip", "the MCP configuration names no (enabled) server")]
    checks = []
    for name, status in found.items():
        if status.problem:
            checks.append(
                Check(
                    f"mcp:{name}",
                    "FAIL",
                    f"{status.described}: {status.problem}",
                    "start the server, or fix its command/url; workers retry it every "
                    f"{s.mcp_retry_seconds:g}s",
                )
            )
        else:
            checks.append(
                Check(f"mcp:{name}", "ok", f"{status.described}: {len(status.tools)} tools")
            )
    return checks


def check_sandbox(ctx: Context) -> Check:
    """Where run_command runs: bubblewrap with its allow-list, or off (sets
    ``ctx.sandbox_ok`` when bubblewrap works)."""
    from charlie import sandbox

    s = ctx.settings
    if s.sandbox == "off":
        return Check(
            "sandbox", "ok", "off (CHARLIE_SANDBOX=off): run_command runs with this worker's rights"
        )
    problem = sandbox.bwrap_problem()
    if problem:
        return Check(
            "sandbox",
            "FAIL",
            f"run_command is refused here: {problem}",
            "install bubblewrap (containers: allow user namespaces, e.g. seccomp "
            "unconfined), or opt out with CHARLIE_SANDBOX=off",
        )
    ctx.sandbox_ok = True
    read = [str(p) for p in sandbox.paths_from_env(s.sandbox_read)]
    missing = [p for p in read if not os.path.isdir(p)]
    return Check(
        "sandbox",
        "ok",
        "bubblewrap, allow-list: commands see the system's programs, a few /etc files, "
        "the toolchain, their workspace and a private /tmp; operator-added read dirs "
        f"(CHARLIE_SANDBOX_READ): {', '.join(read) or 'none'}"
        + (f" (missing: {', '.join(missing)})" if missing else ""),
    )


def check_sandbox_network(ctx: Context) -> Check | None:
    """The network a command allowed it gets (only when the sandbox itself works)."""
    from charlie import sandbox

    if not ctx.sandbox_ok:
        return None
    s = ctx.settings
    try:
        deny = sandbox.networks_from_env(s.sandbox_net_deny)
    except ValueError as exc:
        return Check(
            "sandbox:network",
            "FAIL",
            f"CHARLIE_SANDBOX_NET_DENY is not a list of networks: {exc}",
            "give CIDRs separated by commas, e.g. 10.1.0.0/16,192.0.2.7",
        )
    try:
        stack = sandbox.network_stack(s.sandbox_network)
    except sandbox.SandboxUnavailable as exc:
        # only tasks that ask for the network need it: they get a tool error
        return Check(
            "sandbox:network",
            "skip",
            f"none: {exc}",
            "install passt (pasta) or slirp4netns for tasks that need the network",
        )
    passed_over = sandbox.stack_problem("pasta") if stack != "pasta" else None
    return Check(
        "sandbox:network",
        "ok",
        f"{stack} (CHARLIE_SANDBOX_NETWORK={s.sandbox_network}): a command allowed "
        "the network gets its own namespace, without the host's loopback, addresses or "
        "attached networks"
        + (f", nor {', '.join(deny)}" if deny else "")
        + (f"; not pasta: {passed_over}" if passed_over else ""),
    )


def check_devbox(ctx: Context) -> Check:
    """The devbox answers with this machine's token (when one is configured)."""
    from charlie.devbox.client import DevboxClient, DevboxError, DevboxUnavailable
    from charlie.devbox.credentials import MIN_TOKEN_LENGTH, WeakToken, check_token

    url, token = ctx.settings.devbox_url, ctx.settings.devbox_token
    if not url:
        return Check("devbox", "skip", "not configured (CHARLIE_DEVBOX_URL): tools run locally")
    if not token:
        return Check(
            "devbox",
            "FAIL",
            f"{url} is configured without a token",
            "set CHARLIE_DEVBOX_TOKEN to the token `charlie devbox serve` was given",
        )
    try:
        check_token(token)
    except WeakToken as exc:
        return Check(
            "devbox",
            "FAIL",
            str(exc),
            f"give the devbox and the workers one token of at least {MIN_TOKEN_LENGTH} "
            "characters in CHARLIE_DEVBOX_TOKEN",
        )
    try:
        with DevboxClient(url, token, timeout=ctx.timeout) as client:
            client.health()
    except DevboxError as exc:
        fix = (
            "set CHARLIE_DEVBOX_TOKEN to the token `charlie devbox serve` was given"
            if exc.status == 401
            else "see the devbox's log"
        )
        return Check("devbox", "FAIL", f"{url} refused: {exc}", fix)
    except (DevboxUnavailable, ValueError) as exc:
        return Check(
            "devbox",
            "FAIL",
            f"cannot reach {url}: {_first_line(exc)}",
            "start `charlie devbox serve` there",
        )
    return Check("devbox", "ok", f"{url} answers with the token")


def check_traces(ctx: Context) -> Check:
    """Where spans go (OTEL_*), and that an OTLP endpoint answers."""
    import socket
    from urllib.parse import urlparse

    from charlie.telemetry import environment as tracing

    env = dict(os.environ)
    if not tracing.wanted(env):
        return Check("traces", "skip", "off (no OTEL_EXPORTER_OTLP_ENDPOINT)")
    if "otlp" not in tracing.exporters(env):
        return Check("traces", "ok", f"exported to {', '.join(tracing.exporters(env))}")
    endpoint = tracing.traces_endpoint(env)
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "localhost", port), ctx.timeout):
            pass
    except OSError as exc:
        return Check(
            "traces",
            "FAIL",
            f"the OTLP endpoint {endpoint} does not answer: {_first_line(exc)}",
            "start the collector, or fix OTEL_EXPORTER_OTLP_ENDPOINT (workers run on "
            "without the spans they cannot send)",
        )
    return Check("traces", "ok", f"OTLP/HTTP to {endpoint} answers")


def check_metrics(ctx: Context) -> Check:
    """The Prometheus ports of the workers and the beat (CHARLIE_METRICS_PORT...)."""
    from charlie.telemetry import metrics

    env = dict(os.environ)
    try:
        worker_port = metrics.port_of(env)
        beat_port = metrics.beat_port_of(env)
    except metrics.MetricsError as exc:
        return Check("metrics", "FAIL", str(exc), "fix the port setting")
    if worker_port is None and beat_port is None:
        return Check("metrics", "skip", "off (no CHARLIE_METRICS_PORT)")
    workers = f":{worker_port}/metrics" if worker_port is not None else "(off)"
    return Check(
        "metrics",
        "ok",
        f"Prometheus metrics: workers on {workers}, the beat on :{beat_port}/metrics",
    )


# -- the running deployment --------------------------------------------------------------------


def check_beat(ctx: Context) -> Check:
    """Every sweep ran lately (reads the heartbeats into ``ctx.heartbeats``)."""
    from charlie.domain import utcnow
    from charlie.store.heartbeats import SWEEP_NAMES, load_heartbeats

    if ctx.engine is None or not ctx.schema_read:
        return Check("beat", "skip", "not checked: the database is unreachable or not migrated")
    try:
        with ctx.engine.connect() as conn:
            beats = ctx.heartbeats = load_heartbeats(conn)
    except Exception as exc:
        return Check("beat", "skip", f"not checked: {_first_line(exc)}")
    fix = "run one `charlie beat` (it runs the sweeps itself)"
    limit = max(60.0, 10 * ctx.settings.sweep_interval)
    missing = [name for name in SWEEP_NAMES if name not in beats]
    if missing:
        return Check("beat", "FAIL", f"no {', '.join(missing)} has ever run", fix)
    oldest = min((beats[name] for name in SWEEP_NAMES), key=lambda b: b.at)
    age = (utcnow() - oldest.at).total_seconds()
    if age > limit:
        return Check(
            "beat",
            "FAIL",
            f"the last {oldest.name} ran {_ago(age)} ago ({_when(oldest.at)}, {oldest.worker})",
            fix,
        )
    return Check("beat", "ok", f"every sweep ran within {_ago(age)} (last by {oldest.worker})")


def check_workers(ctx: Context) -> Check:
    """Workers said they are alive lately, and together consume the queues work goes to."""
    from charlie.domain import utcnow
    from charlie.presence import EVERY, WAITING
    from charlie.store.heartbeats import WORKER_PREFIX

    if ctx.heartbeats is None:
        return Check("workers", "skip", "not checked: the database is unreachable or not migrated")
    s = ctx.settings
    now = utcnow()
    recent = {
        name.removeprefix(WORKER_PREFIX): beat
        for name, beat in ctx.heartbeats.items()
        if name.startswith(WORKER_PREFIX) and (now - beat.at).total_seconds() <= 6 * EVERY
    }
    # Rolling upgrades: a worker whose code does not fit the schema waits, and says why.
    waiting = {
        node: (beat.detail or "").removeprefix(WAITING)
        for node, beat in recent.items()
        if (beat.detail or "").startswith(WAITING)
    }
    alive = {node: beat for node, beat in recent.items() if node not in waiting}
    said = (
        f"{len(waiting)} waiting, claiming no work: "
        + "; ".join(f"{node}: {why}" for node, why in sorted(waiting.items()))
        if waiting
        else ""
    )
    upgrade = (
        "run `charlie db upgrade` for workers newer than the schema; upgrade Charlie on the "
        "machines of workers older than its floor"
    )
    if not alive:
        if waiting:
            return Check("workers", "FAIL", said, upgrade)
        return Check(
            "workers",
            "FAIL",
            f"no worker has said it is alive in the last {6 * EVERY:.0f} s",
            "start `charlie worker` (each records a heartbeat in the database)",
        )
    consumed = {q for beat in alive.values() for q in (beat.detail or "").split(",") if q}
    wanted = [TICK_QUEUE, *([s.intake_queue] if s.intake_queue else [])]
    unserved = [q for q in wanted if q not in consumed]
    if unserved:
        return Check(
            "workers",
            "FAIL",
            f"{len(alive)} alive, but none consumes {', '.join(map(repr, unserved))}"
            + (f"; {said}" if said else ""),
            f"start workers with `-Q {','.join(s.worker_queues)}` (the default of "
            "`charlie worker`)",
        )
    detail = f"{len(alive)} alive: {', '.join(sorted(alive))}"
    if waiting:
        return Check("workers", "WARN", f"{detail}; {said}", upgrade)
    return Check("workers", "ok", detail)


def check_connections(ctx: Context) -> Check:
    """Connections in use against the server's max_connections, and what the running fleet
    may open (docs/production/pgbouncer.md, the connection budget)."""
    from charlie.domain import utcnow
    from charlie.presence import BUDGET_PREFIX, EVERY, WAITING
    from charlie.store.heartbeats import WORKER_PREFIX
    from charlie.store.probe import connection_counts, port_of

    s = ctx.settings
    if s.is_sqlite:
        return Check("connections", "skip", "SQLite: no server connection limit")
    if ctx.engine is None:
        return Check("connections", "skip", "not checked: the database is unreachable")
    try:
        row = connection_counts(ctx.engine)
    except Exception as exc:
        return Check("connections", "skip", f"not checked: {_first_line(exc)}")
    in_use, here, limit, reserved, server_port = row
    usable = int(limit) - int(reserved)
    per_process = s.db_pool_size + s.db_max_overflow
    url_port = port_of(s.database_url)
    pooled = server_port is not None and int(server_port) != url_port
    detail = (
        f"{in_use} of max_connections {limit} in use ({here} on this database, "
        f"{reserved} reserved for superusers); a process here may hold "
        f"{per_process} (CHARLIE_DB_POOL_SIZE {s.db_pool_size} + "
        f"CHARLIE_DB_MAX_OVERFLOW {s.db_max_overflow})"
    )
    fleet = None
    if ctx.heartbeats is not None:
        now = utcnow()
        recent = {
            name.removeprefix(WORKER_PREFIX)
            for name, beat in ctx.heartbeats.items()
            if name.startswith(WORKER_PREFIX)
            and (now - beat.at).total_seconds() <= 6 * EVERY
            and not (beat.detail or "").startswith(WAITING)
        }
        budgets = [
            int(beat.detail or 0)
            for name, beat in ctx.heartbeats.items()
            if name.startswith(BUDGET_PREFIX)
            and name.removeprefix(BUDGET_PREFIX) in recent
            and (beat.detail or "").isdigit()
        ]
        fleet = sum(budgets) + per_process  # the workers that said, and one beat
        detail += (
            f"; the running fleet may open {fleet} ({len(budgets)} worker(s) and a beat), "
            f"plus {per_process} per producer or console process"
        )
    if pooled:
        return Check(
            "connections",
            "ok",
            f"through a pooler (the server listens on {server_port}, the URL names "
            f"{url_port}): {detail}; the processes' pools count against the pooler's "
            "client limit (PgBouncer: max_client_conn), PostgreSQL sees its pool",
        )
    fix = (
        "lower CHARLIE_DB_POOL_SIZE / CHARLIE_DB_MAX_OVERFLOW, raise max_connections, or put "
        "PgBouncer (transaction pooling) in front (docs/production/pgbouncer.md)"
    )
    if int(in_use) >= 0.9 * usable:
        return Check("connections", "WARN", f"nearly full: {detail}", fix)
    if fleet is not None and fleet > usable - (int(in_use) - int(here)):
        return Check(
            "connections", "WARN", f"the fleet could exceed max_connections: {detail}", fix
        )
    return Check("connections", "ok", detail)


def check_worker_pools(ctx: Context) -> list[Check] | None:
    """Each live worker's pool and the model calls it had in flight at its last heartbeat
    (read by ``check_workers``); informational."""
    if ctx.heartbeats is None:
        return None
    from charlie.domain import utcnow

    return worker_pools(ctx.heartbeats, utcnow())


def worker_pools(heartbeats: dict[str, Any], now: datetime) -> list[Check]:
    """Each live worker's pool and what it had in flight at its last heartbeat (the presence
    heartbeat's pool report): "threads 64: 12 model calls in flight (at most 40 since the beat
    before)". Informational: a worker of an earlier release reports none and is left out."""
    from charlie.presence import live_pools

    return [
        Check(
            "worker pool",
            "ok",
            f"{node}: {fields.get('pool')} {fields.get('concurrency')}: "
            f"{fields.get('in_flight')} {fields.get('counts')} in flight (at most "
            f"{fields.get('peak')} since the beat before)",
        )
        for node, fields in live_pools(heartbeats, now)
    ]


#: every check, in the order `charlie doctor` prints them: a check reads what the ones before
#: it found (``Context``). A new check is a function of a Context that returns a Check (or a
#: list of them, or None when it does not apply), added here where it belongs.
def paused_limits(statuses: Iterable[Any], now: datetime) -> list[Check]:
    """A WARN for each provider limit a provider has paused (``statuses``: the store's
    LimitStatus rows): every caller of it waits until then, and an operator can lift it."""
    found = []
    for status in statuses:
        until = status.paused_until
        if until is not None and until.tzinfo is None:
            until = until.replace(tzinfo=UTC)
        if until is None or until <= now:
            continue
        left = (until - now).total_seconds()
        found.append(
            Check(
                "model limit paused",
                "WARN",
                f"{status.key}: the provider asked every caller to wait until "
                f"{until.isoformat(timespec='seconds')} ({left:.0f} s left; {status.in_flight} "
                f"in flight, {status.waiting} waiting)",
                f"wait, or lift it: charlie limits resume {status.key}",
            )
        )
    return found


def broker_is_loopback(url: str) -> bool:
    """Whether every host a broker URL names is this machine (loopback, a Unix socket, or the
    embedded broker's directory): a client elsewhere cannot publish to it."""
    from urllib.parse import urlsplit

    if url.startswith(("charliefs://", "memory://", "filesystem://", "redis+socket://")):
        return True
    for part in url.split(";"):
        try:
            host = (urlsplit(part.strip()).hostname or "").lower()
        except ValueError:
            return False
        if host in ("localhost", "localhost.localdomain", "ip6-localhost"):
            continue
        try:
            if ipaddress.ip_address(host).is_loopback:
                continue
        except ValueError:
            pass
        return False
    return True


def unsigned_broker_actions(s: Settings) -> Check | None:
    """A WARN when anyone who can publish to a broker reachable from elsewhere can act as an
    operator: actions by Celery message on (CHARLIE_CELERY_OPERATOR_ACTIONS, the default),
    messages unsigned (the default), and the broker not on this machine's loopback (I32: such
    an action is recorded as claimed, but it is taken)."""
    if not s.celery_operator_actions or s.signs_messages or broker_is_loopback(s.broker_url):
        return None
    return Check(
        "operator actions",
        "WARN",
        f"any client of the broker at {_safe_url(s.broker_url)} can approve, deny, reply, "
        "resume and cancel by Celery message under a name it claims: actions by message are "
        "on and messages are not signed",
        "turn actions by message off (CHARLIE_CELERY_OPERATOR_ACTIONS=0), or sign messages "
        "(CHARLIE_SECURITY_KEY, CHARLIE_SECURITY_CERTIFICATE, CHARLIE_SECURITY_CERT_STORE; "
        "docs/security.md)",
    )


def event_stream_check(s: Settings) -> tuple[str, str, str, str] | None:
    """(name, status, detail, fix) for the RabbitMQ event stream's bounds, or None when the
    events go elsewhere (Redis, files, none)."""
    target = s.stream_target
    if target is None or not target.startswith(("amqp://", "amqps://", "pyamqp://")):
        return None
    from charlie.streams.rabbitmq_stream import QUEUE, bounds_differ

    try:
        differs = bounds_differ(target, ttl=s.stream_ttl, max_events=s.stream_max_events)
    except Exception as exc:
        return ("event stream", "WARN", f"{QUEUE!r} could not be checked: {_first_line(exc)}", "")
    if differs is None:
        detail = f"{QUEUE!r} has these settings' bounds (or no worker declared it yet)"
        return ("event stream", "ok", detail, "")
    return (
        "event stream",
        "WARN",
        f"{QUEUE!r} exists with other bounds than CHARLIE_STREAM_TTL and "
        f"CHARLIE_STREAM_MAX_EVENTS give it; the workers use it as it is: {differs}",
        "give every deployment on this vhost the same CHARLIE_STREAM_TTL and "
        "CHARLIE_STREAM_MAX_EVENTS, or, to take these bounds, delete the queue while no one "
        f"watches (`rabbitmqctl delete_queue {QUEUE}`: its events go with it)",
    )


CHECKS: list[Callable[[Context], Found]] = [
    check_database,
    check_schema,
    check_signing,
    check_operator_actions,
    check_broker,
    check_event_stream,
    check_tools,
    check_model_limits,
    check_model_retries,
    check_mcp,
    check_sandbox,
    check_sandbox_network,
    check_devbox,
    check_traces,
    check_metrics,
    check_beat,
    check_workers,
    check_worker_pools,
    check_connections,
]


#: in use server-wide and on this database, the limit, the superusers' reserve, and the port
#: the server listens on (another than the URL's: a pooler is in between)
def _ago(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _when(at: datetime) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S UTC")


@contextmanager
def _quiet_kombu() -> Iterator[None]:
    """kombu logs every failed connection attempt; the check line already says it."""
    import logging

    logger = logging.getLogger("kombu")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def run_checks(settings: Settings, timeout: float = 3.0) -> list[Check]:
    """Every check of ``CHECKS`` in order, each given what the earlier ones found."""
    ctx = Context(settings, timeout)
    found: list[Check] = []
    with _quiet_kombu():
        for check in CHECKS:
            result = check(ctx)
            if isinstance(result, Check):
                found.append(result)
            elif result:
                found.extend(result)
    return found


def as_json(checks: list[Check]) -> list[dict[str, Any]]:
    return [asdict(c) for c in checks]


def diagnose(timeout: float = 3.0) -> tuple[list[Check], int]:
    """Every check for this process's environment, and the exit status: 0 only when none
    failed."""
    from charlie.config import settings

    try:
        s = settings()
    except ValueError as exc:
        return [Check("config", "FAIL", str(exc), "fix the CHARLIE_* variable it names")], 1
    checks = run_checks(s, timeout)
    return checks, 1 if any(c.failed for c in checks) else 0
