"""Settings, read once from the environment, with the embedded defaults.

Everything operators tune lives here so that a worker, beat and a producer started with the same
environment agree on where the database and the broker are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not a number") from exc


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not a whole number") from exc


def _env_positive(name: str, value: float) -> None:
    if not 0 < value < float("inf"):
        raise ValueError(f"{name}={os.environ.get(name)!r} must be positive (unset: no limit)")


def _env_seconds(name: str, default: float) -> float:
    """A positive, finite number of seconds."""
    value = _env_float(name, default)
    if not 0 < value < float("inf"):
        raise ValueError(f"{name}={os.environ.get(name)!r} must be a positive number of seconds")
    return value


def _env_bound(name: str, default: int) -> int:
    """A whole number from 0 (a limit that refuses everything past it)."""
    value = _env_int(name, default)
    if value < 0:
        raise ValueError(f"{name}={os.environ.get(name)!r} must be 0 or more")
    return value


def _env_at_least_one(name: str, default: int) -> int:
    value = _env_int(name, default)
    if value < 1:
        raise ValueError(f"{name}={os.environ.get(name)!r} must be 1 or more")
    return value


def _env_limit_int(name: str) -> int | None:
    """A positive whole budget limit, or None when unset (no default limit)."""
    if not os.environ.get(name, "").strip():
        return None
    value = _env_int(name, 0)
    _env_positive(name, value)
    return value


def _env_limit_float(name: str) -> float | None:
    if not os.environ.get(name, "").strip():
        return None
    value = _env_float(name, 0.0)
    _env_positive(name, value)
    return value


def _env_flag(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={raw!r} is not one of 1, 0, true, false, yes, no, on, off")


LOG_FORMATS = ("text", "json")

#: the queue of ticks and tool invocations (every Charlie task but the sweeps).
TICK_QUEUE = "charlie"
#: the sweeps' own queue: recovery must not wait behind the backlog it is there to clear.
SWEEP_QUEUE = "charlie.sweeps"


#: the Redis transport's priority steps: kombu's own default, so that every worker of any
#: version consumes every level (each step is a list of its own, ``charlie\x06\x16<step>``,
#: and a worker pops from the lists of the steps it knows only), and 0 is the level taken
#: first: a message published with no priority lands there.
REDIS_PRIORITY_STEPS = (0, 3, 6, 9)
#: the range ``submit(priority=...)`` takes (higher first).
PRIORITY_RANGE = 1000


def broker_priority(priority: int, levels: tuple[int, ...]) -> int | None:
    """The broker priority a message of a task of ``priority`` is published with, ``levels``
    being the broker's values from the one taken last to the one taken first (see
    ``Settings.broker_priorities``); None where the broker has none.

    Priority 0, the default, goes to the middle level (the lower middle of an even count), so
    that a task above it and a task below it are both ordered against the bulk of the work;
    1..1000 are split evenly over the levels above it, -1..-1000 over those below. Any
    priority above 0 outranks 0 at the broker; finer distinctions than the levels allow are
    kept among waiting model calls only."""
    if not levels:
        return None
    middle = (len(levels) - 1) // 2
    bounded = max(-PRIORITY_RANGE, min(PRIORITY_RANGE, priority))
    if bounded >= 0:
        return levels[middle + _share(bounded, len(levels) - 1 - middle)]
    return levels[middle - _share(-bounded, middle)]


def _share(magnitude: int, steps: int) -> int:
    """How many of ``steps`` levels a priority of ``magnitude`` (0..1000) moves: rounded up,
    so that any priority but 0 moves one at least (where there is one)."""
    return (magnitude * steps + PRIORITY_RANGE - 1) // PRIORITY_RANGE


def queue_mismatch_hint(error: BaseException) -> str:
    """What to do, when ``error`` is RabbitMQ refusing to declare the tick queue with another
    ``x-max-priority`` than the queue it has (PRECONDITION_FAILED); else ""."""
    text = str(error)
    if "PRECONDITION_FAILED" not in text or "x-max-priority" not in text:
        return ""
    return (
        f": RabbitMQ has the queue {TICK_QUEUE!r} with another x-max-priority than this "
        "process declares (CHARLIE_RABBITMQ_MAX_PRIORITY): give every worker, beat and producer "
        f"the same value, or, changing it, stop them all, delete the queue ({TICK_QUEUE!r}; "
        "the sweeps re-publish what it held) and start them with the new value "
        "(docs/models/limits.md, Priorities at the broker)"
    )


def _env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    raw = os.environ.get(name) or default
    if raw not in choices:
        raise ValueError(f"{name}={raw!r} is not one of {', '.join(choices)}")
    return raw


@dataclass(frozen=True)
class Settings:
    #: the home of the embedded database, broker, workspaces and beat schedule (default
    #: ``./.charlie``); created private to its user (0700, Charlie's files in it 0600), and an
    #: existing one open to group or others is tightened, with a warning.
    home: Path
    #: the SQLAlchemy URL of the database (default: SQLite under the home): ``postgresql://...``
    #: (SQLAlchemy's default driver: psycopg 3 on 2.1, psycopg2 on 2.0),
    #: ``postgresql+psycopg://`` or ``postgresql+psycopg2://``; both drivers are installed.
    database_url: str
    #: the broker (default ``charliefs://``, the embedded one under the home's ``broker``):
    #: ``redis://...`` or ``amqp://...`` in production.
    broker_url: str
    #: comma-separated modules workers import so their ``@charlie.tool`` functions register; a
    #: producer imports them only to check a tool name it does not know.
    tool_modules: tuple[str, ...] = ()
    #: I14: at most this many new tool dispatches per tick.
    dispatch_batch: int = 8
    #: I5: a lease a worker holds on an execution or a tool call while it works; renewed by a
    #: heartbeat every third of it, so a killed worker's lease lapses within this many seconds.
    lease_seconds: float = 5.0
    #: how often beat runs the sweeps (seconds). ``charlie beat`` runs them in its own process,
    #: so recovery never waits for a free worker slot; ``--celery-beat`` queues them to the
    #: workers instead.
    sweep_interval: float = 1.0
    #: I4: a run that is ready but has not moved for this long gets its tick published again.
    stall_seconds: float = 5.0
    #: run up to this many following steps (the run's next phase, or a turn's only tool call)
    #: straight away in the same worker instead of publishing them: each is still claimed,
    #: committed and recorded on its own, and reported to Flower as a task of its own (I21).
    #: 0 publishes every step. A chain also stops after 30 seconds, and goes on past its
    #: steps until it has run half a second: each stop costs a publish and a claim of its own
    #: (and in a prefork pool often a cold transcript cache), and with a real model a chain
    #: meets the 30 s first.
    inline_phases: int = 30
    #: with inline steps on, carry the effect-free phase transitions that follow a commit in
    #: that same transaction (each its own claim, transition row and version), up to the next
    #: step with an outside effect: a model call (its claim commits in it), a tool handler (its
    #: start commits in it), a publish (after it). False: one commit per phase.
    merge_phases: bool = True
    #: on PostgreSQL, write a merged transaction's steps in one statement (a fused commit: one
    #: round trip, the rows checked as predicted, else written step by step). False: one
    #: statement per write, as on SQLite. A read this worker runs itself starts in the model's
    #: commit: a one-call turn in two commits, each one round trip.
    fuse_commits: bool = True
    #: a turn of at most this many calls, each of a ``threadsafe`` tool, runs them in the
    #: worker that dispatched them, at once (a thread each), where each would otherwise go
    #: through the broker to a worker of its own: K calls in K + 2 commits at most.
    #: 1: only a turn's single call runs there (any tool).
    local_calls: int = 8
    #: while more messages than this wait in the broker queue, the sweep does not re-publish
    #: runs that merely look stalled: in a backlog their ticks are queued, not lost.
    sweep_backlog_limit: int = 200
    #: ...but a run stalled this long is re-published even in a backlog (once per this period),
    #: so a tick that was really lost while the queue was deep waits at most this long (I4).
    sweep_backlog_max_wait: float = 120.0
    #: how often (seconds) the stalled-run sweep also probes the runs waiting in await_tools
    #: for one whose turn has settled and whose tick is lost without a wake-up to find it by
    #: (a worker of a release before migration 0016, a publish lost where none is stored): a
    #: read of every such run, so not every round (about 30 ms at 20,000 runs waiting for
    #: people). The wake-up a completing settle stores finds the usual case within a stall
    #: period.
    sweep_probe_seconds: float = 60.0
    #: poison messages: a tick or a tool invocation claimed this many times without finishing
    #: ends the run in report_failure (or the call as interrupted) instead of looping.
    max_attempts: int = 5
    #: default per-call deadline when a tool declares none.
    tool_deadline: float = 300.0
    #: how long an ``ask_human`` question waits for a reply before it settles
    #: ``deadline_exceeded`` (a later reply is a late report).
    human_deadline: float = 86400.0
    #: who an operator action is recorded as when the caller names nobody (I27); unset: the OS
    #: user of the process.
    operator: str | None = None
    #: I13: a resumable wait settled past its deadline goes on being observed (every
    #: stall_seconds) for this long, so the outside work's later end is recorded as a late report.
    late_watch_seconds: float = 3600.0
    #: tool results larger than this are truncated (and say so) before they enter the transcript.
    max_result_bytes: int = 256 * 1024
    #: prompts larger than this are refused at submit.
    max_prompt_bytes: int = 1024 * 1024
    #: how many times report_terminal retries a transient scheduler write inside one tick before
    #: it stores a wake-up time and lets the sweep come back.
    report_retries: int = 4
    #: how long a run keeps retrying a model call that fails in a way waiting may fix (a
    #: connection refused, a timeout, a 429 or 5xx), in seconds from its first failure; past it
    #: the task fails with the last error (I36). Errors waiting cannot fix (401, 403, an unknown
    #: model, a malformed request) fail at once.
    model_retry_seconds: float = 600.0
    #: the embedded broker's polling interval (seconds); an idle worker spends about 1.5% of a
    #: core on it.
    embedded_poll_interval: float = 0.005
    #: Celery task events, for Flower: on unless the broker is the embedded one.
    task_events: bool = False
    extra: dict[str, str] = field(default_factory=dict)
    #: the devbox (``charlie devbox serve``) the tools run in; unset: the local tools. When set,
    #: run_command, read_file, write_file and list_files are the devbox's, plus apply_patch,
    #: git_diff and git_commit (charlie/tools/devbox_tools.py). The token is at least 32
    #: characters (``secrets.token_urlsafe(32)``), or the devbox will not start and the
    #: workers' devbox tools fail.
    devbox_url: str | None = None
    devbox_token: str | None = field(default=None, repr=False)
    #: how long one HTTP request to the devbox may take (a first clone happens in one).
    devbox_timeout: float = 60.0
    #: run_command observes its command for this long inside one invocation before it parks
    #: the call and lets the sweep poll it again after ``devbox_poll_interval``.
    devbox_inline_wait: float = 5.0
    devbox_poll_interval: float = 2.0
    #: run_command's tool deadline (I13): past it the call settles ``deadline_exceeded`` (the
    #: command is not killed by it).
    devbox_command_deadline: float = 900.0
    #: worker log lines: ``text`` appends each record's context (run, phase, call) as
    #: key=value pairs; ``json`` prints one JSON object per line (charlie/logs.py). With
    #: tracing on, each line also says its ``trace_id``.
    log_format: str = "text"
    #: the queue a producer that has only Celery publishes ``charlie.submit`` to when it sets
    #: no routing: Celery's default queue. Workers consume it too; empty: none.
    intake_queue: str = "celery"
    #: Celery's remote control (inspect, ping, revoke broadcasts) for workers: off unless asked
    #: for (CHARLIE_REMOTE_CONTROL=1; Flower's worker pages need it). Anyone who can publish to
    #: the broker can use it; `charlie doctor` sees workers through their heartbeats instead.
    remote_control: bool = False
    #: the people in the loop's actions as Celery tasks (``charlie.approve``, ``charlie.send``...):
    #: their name is whatever the message claims (I32), so a deployment that does not trust
    #: every broker client turns them off (CHARLIE_CELERY_OPERATOR_ACTIONS=0): such a message
    #: is refused and logged, and nothing is recorded.
    celery_operator_actions: bool = True
    #: the longest wait (seconds) a provider's answer may impose on a call and on every caller
    #: of its limit (``Retry-After``, ``retry-after-ms``, the rate-limit reset headers): a
    #: longer one is cut to this, with a warning naming the provider's value.
    model_retry_after_max: float = 600.0
    #: Celery's message signing (its ``auth`` serializer): this process's private key (PEM),
    #: its certificate, and the certificates whose signatures it accepts (a directory or a
    #: glob). All three, or none: with them every message Charlie publishes is signed and
    #: every task message a worker takes must carry a signature of a certificate in the store.
    security_key: str | None = None
    security_certificate: str | None = None
    security_cert_store: str | None = None
    security_key_password: str | None = field(default=None, repr=False)
    #: how the local run_command confines commands: ``bwrap`` (bubblewrap; commands are refused
    #: where it cannot run) or ``off`` (the operator's explicit opt-out: commands run with the
    #: worker's rights). charlie/sandbox.py says what the sandbox hides.
    sandbox: str = "bwrap"
    #: more paths (``:``-separated) the sandbox hides where they lie inside something it shows.
    sandbox_hide: str = ""
    #: directories (``:``-separated) commands may read besides the sandbox's allow-list (the
    #: system's programs, a few /etc files, the toolchain, the workspace): CHARLIE_SANDBOX_READ.
    #: Nothing else of the machine is visible. The devbox reads it too.
    sandbox_read: str = ""
    #: the user-mode network stack for commands whose task allows the network: ``auto`` (pasta
    #: where it works, else slirp4netns), ``pasta`` or ``slirp4netns``. Such a command has its
    #: own network namespace, without the host's loopback, its addresses or the networks it is
    #: attached to; with neither stack it is refused with an error naming what to install.
    sandbox_network: str = "auto"
    #: networks (comma-separated CIDRs) such commands must not reach besides the host's own
    #: addresses and attached networks and the cloud metadata address: the cluster's services
    #: further away
    #: (CHARLIE_SANDBOX_NET_DENY).
    sandbox_net_deny: str = ""
    #: where a task's ``metadata["workspace"]`` may be (CHARLIE_WORKSPACE_ROOTS, ``:``-separated;
    #: empty: ``home/workspaces`` only). A workspace must lie strictly inside one of them (its
    #: real path, symlinks resolved); another is refused at submit, and by the worker before
    #: any tool runs.
    workspace_roots: tuple[Path, ...] = ()
    #: models a delegated child may use besides its parent's (CHARLIE_DELEGATE_MODELS: a comma
    #: list of model names or glob patterns, ``*`` for any); empty: only the parent's model. A
    #: ``scripted:`` model only ever for a child of a scripted parent, whatever this says.
    delegate_models: tuple[str, ...] = ()
    #: how deep delegation may nest (CHARLIE_DELEGATE_MAX_DEPTH): a submitted task is at depth
    #: 0, its child at 1; a task at this depth cannot delegate. 0: no delegation at all.
    delegate_max_depth: int = 3
    #: how many children one task may start in all (CHARLIE_DELEGATE_MAX_CHILDREN).
    delegate_max_children: int = 16
    #: a model's context window in tokens (CHARLIE_MODEL_CONTEXT_TOKENS); per model,
    #: CHARLIE_MODEL_<NAME>_CONTEXT_TOKENS (``context_tokens_by_model``, keyed by ``<NAME>``).
    #: Unset: Charlie learns the window from the provider's refusal (charlie/executor/context.py).
    model_context_tokens: int | None = None
    context_tokens_by_model: dict[str, int] = field(default_factory=dict)
    #: MCP tool servers (charlie/mcp/): CHARLIE_MCP_CONFIG, a path to a JSON file in the shape
    #: MCP clients use ({"mcpServers": {...}}), and/or the same object inline in
    #: CHARLIE_MCP_SERVERS (which may hold secrets: never printed).
    mcp_config: str | None = None
    mcp_servers: str | None = field(default=None, repr=False)
    #: how long connecting to an MCP server and listing its tools may take (seconds).
    mcp_timeout: float = 10.0
    #: a server that could not be reached is tried again after this many seconds.
    mcp_retry_seconds: float = 30.0
    #: the most of one message from an MCP server that is read (a larger answer is dropped
    #: unread and its call gets an error; charlie/mcp/bounded.py). A server's stderr lines are
    #: cut at 8 KiB.
    mcp_max_message_bytes: int = 4 * 1024 * 1024
    #: CHARLIE_PRICES: the price table, inline JSON or a JSON file's path; read by
    #: ``charlie.pricing.price_table(settings.prices)``. Unset: scripted models cost 0, others
    #: have no known price (docs/models/index.md, Budgets and cost).
    prices: str | None = None
    #: CHARLIE_MODEL_LIMITS: the provider limits the fleet keeps (concurrency, rpm, tpm per
    #: model spec or prefix), inline JSON or a JSON file's path; read by
    #: ``charlie.limits.limit_table(settings.model_limits)``.
    model_limits: str | None = None
    #: default budget limits, applied at submit and stored on the task (and a ceiling for
    #: delegated children, whose budget is what their parent has left): None, none.
    budget_tokens: int | None = None
    budget_usd: float | None = None
    budget_model_calls: int | None = None
    #: streaming for people watching (charlie/streams/): what the model writes, tool calls as
    #: they start and settle, waits and the end, to ``charlie watch``, ``charlie.events`` and
    #: the console. Never the answer (I28). CHARLIE_STREAMING=0 turns it off.
    streaming: bool = True
    #: where the events go (CHARLIE_STREAM_URL): ``redis://...`` (a Redis Stream per task),
    #: ``amqp://...`` (one RabbitMQ stream queue) or ``file://DIR`` (a file per task, one
    #: machine); unset: the broker (Redis or RabbitMQ), or ``home/streams`` with the embedded
    #: broker, or none (a broker that cannot carry them: SQS, ...).
    stream_url: str | None = None
    #: a task's events are dropped this long after its last one (seconds).
    stream_ttl: float = 3600.0
    #: at most about this many events kept per task (Redis MAXLEN ~; files: x 512 bytes).
    stream_max_events: int = 20000
    #: CHARLIE_DB_POOL_SIZE: database connections each process (a worker's pool process, its
    #: main process, beat, a producer, the console) keeps open to a server database.
    db_pool_size: int = 5
    #: CHARLIE_DB_MAX_OVERFLOW: more connections a process may open under load beyond
    #: CHARLIE_DB_POOL_SIZE (closed when returned). A process holds at most the sum; the fleet's
    #: budget against PostgreSQL's max_connections is in docs/production/pgbouncer.md.
    db_max_overflow: int = 10
    #: CHARLIE_DB_PREPARE: whether a turn's fused commits are prepared on PostgreSQL (parsed
    #: and planned once per connection, not at each turn): ``auto`` (on a connection that
    #: reaches PostgreSQL itself, not through PgBouncer or another proxy), ``on`` (also
    #: through a PgBouncer of 1.22 or later with ``max_prepared_statements`` set), ``off``.
    db_prepare: str = "auto"
    #: CHARLIE_RABBITMQ_MAX_PRIORITY: on RabbitMQ, the ``x-max-priority`` of the tick queue
    #: (``charlie``), 1 to 255 (RabbitMQ advises at most 10), so that a task's ``priority``
    #: orders its ticks and tool invocations among those waiting there; unset or 0: none (the
    #: queue as before). RabbitMQ refuses to declare an existing queue with other arguments
    #: (PRECONDITION_FAILED): set it on every worker, beat and producer at once, with the old
    #: queue deleted (docs/models/limits.md says how; the sweeps re-publish what it held).
    #: Redis needs no setting (its levels are kombu's priority steps); the embedded broker has
    #: no priorities.
    rabbitmq_max_priority: int = 0
    #: CHARLIE_REDIS_PRIORITIES=1: on Redis, a task's ``priority`` orders its ticks and tool
    #: invocations among those waiting in the broker (kombu's priority steps; nothing to
    #: declare). Off by default: measured against a provider limit of 4 in flight
    #: (``scripts/bench.py --only limits``), the fleet kept 72% of what the provider allows
    #: with it on, 94% with it off (docs/models/limits.md); a turn's overhead is the same.
    redis_priorities: bool = False

    @property
    def is_rabbitmq(self) -> bool:
        return self.broker_url.startswith(("amqp://", "amqps://", "pyamqp://"))

    @property
    def is_redis_broker(self) -> bool:
        return self.broker_url.startswith(("redis://", "rediss://", "sentinel://"))

    @property
    def broker_priorities(self) -> tuple[int, ...]:
        """The broker's message priorities, from the one taken last to the one taken first
        (config.broker_priority maps a task's priority onto them); () where it has none: the
        embedded broker, Redis without CHARLIE_REDIS_PRIORITIES, RabbitMQ without
        CHARLIE_RABBITMQ_MAX_PRIORITY, other transports.
        On Redis a lower number is taken first (0, the level of a message without one, first
        of all); on RabbitMQ a higher one (0, the level of a message without one, last)."""
        if self.is_redis_broker and self.redis_priorities:
            return tuple(reversed(REDIS_PRIORITY_STEPS))
        if self.is_rabbitmq and self.rabbitmq_max_priority:
            return tuple(range(self.rabbitmq_max_priority + 1))
        return ()

    @property
    def stream_target(self) -> str | None:
        """Where the events go, or None when streaming is off or this broker cannot carry
        them (SQS, ...: set CHARLIE_STREAM_URL=redis://... for those)."""
        if not self.streaming:
            return None
        if self.stream_url:
            return self.stream_url
        if self.is_embedded_broker:
            return f"file://{self.home / 'streams'}"
        if self.broker_url.startswith(
            ("redis://", "rediss://", "amqp://", "amqps://", "pyamqp://")
        ):
            return self.broker_url
        return None

    @property
    def budget_defaults(self) -> dict[str, float | int | None]:
        return {
            "tokens": self.budget_tokens,
            "usd": self.budget_usd,
            "model_calls": self.budget_model_calls,
        }

    @property
    def signs_messages(self) -> bool:
        """Celery's message signing is on: messages are published signed, taken signed only."""
        return self.security_key is not None

    @property
    def worker_queues(self) -> tuple[str, ...]:
        """The queues ``charlie worker`` consumes unless told otherwise."""
        extra = (self.intake_queue,) if self.intake_queue else ()
        return (TICK_QUEUE, SWEEP_QUEUE, *extra)

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    @property
    def is_embedded_broker(self) -> bool:
        return self.broker_url.startswith("charliefs://")

    @property
    def broker_dir(self) -> Path:
        return self.home / "broker"

    @property
    def workspaces_dir(self) -> Path:
        return self.home / "workspaces"

    @property
    def allowed_workspace_roots(self) -> tuple[Path, ...]:
        return self.workspace_roots or (self.workspaces_dir,)

    def confine_workspace(self, raw: object) -> Path:
        """The real path of a task's ``metadata["workspace"]``, which must lie strictly inside
        one of the allowed roots (the roots themselves hold other tasks' workspaces); a
        WorkspaceRefused naming the roots otherwise."""
        roots = self.allowed_workspace_roots
        if not isinstance(raw, str) or not raw or "\x00" in raw:
            raise WorkspaceRefused("metadata.workspace must be a non-empty path string")
        if not os.path.isabs(raw):
            raise WorkspaceRefused(f"metadata.workspace {raw!r} must be an absolute path")
        real = Path(os.path.realpath(raw))
        for root in roots:
            base = Path(os.path.realpath(root))
            if base in real.parents:
                return real
        shown = ":".join(str(r) for r in roots)
        raise WorkspaceRefused(
            f"workspace {raw!r} is outside the allowed workspace roots ({shown}); a task's "
            "workspace must be a directory inside one of them (CHARLIE_WORKSPACE_ROOTS)"
        )


class WorkspaceRefused(ValueError):
    """A task's workspace lies outside the operator's workspace roots."""


def _paths(raw: str) -> tuple[Path, ...]:
    return tuple(Path(p).expanduser().resolve() for p in raw.split(":") if p.strip())


def _context_overrides() -> dict[str, int]:
    """CHARLIE_MODEL_<NAME>_CONTEXT_TOKENS, by ``<NAME>`` (models.retry.env_name)."""
    found: dict[str, int] = {}
    for key in os.environ:
        if key.startswith("CHARLIE_MODEL_") and key.endswith("_CONTEXT_TOKENS"):
            name = key[len("CHARLIE_MODEL_") : -len("_CONTEXT_TOKENS")]
            value = _env_limit_int(key)
            if name and value is not None:
                found[name] = value
    return found


def database_url_of(url: str) -> str:
    """The URL as SQLAlchemy takes it: ``postgres://`` (what most hosts hand out, and what
    people paste) is PostgreSQL's other spelling, read as ``postgresql://``."""
    url = url.strip()
    for spelling in ("postgres://", "postgres+"):
        if url.startswith(spelling):
            return "postgresql" + url[len("postgres") :]
    return url


def load_settings() -> Settings:
    home = Path(os.environ.get("CHARLIE_HOME", ".charlie")).resolve()
    database_url = database_url_of(
        os.environ.get("CHARLIE_DATABASE_URL") or f"sqlite:///{home / 'charlie.db'}"
    )
    broker_url = os.environ.get("CHARLIE_BROKER_URL") or "charliefs://"
    modules = tuple(
        m.strip() for m in os.environ.get("CHARLIE_TOOL_MODULES", "").split(",") if m.strip()
    )
    events_raw = os.environ.get("CHARLIE_TASK_EVENTS")
    task_events = (
        events_raw.lower() in ("1", "true", "yes", "on")
        if events_raw
        else not broker_url.startswith("charliefs://")
    )
    return Settings(
        home=home,
        database_url=database_url,
        broker_url=broker_url,
        tool_modules=modules,
        dispatch_batch=_env_int("CHARLIE_DISPATCH_BATCH", 8),
        lease_seconds=_env_float("CHARLIE_LEASE_SECONDS", 5.0),
        sweep_interval=_env_float("CHARLIE_SWEEP_INTERVAL", 1.0),
        stall_seconds=_env_float("CHARLIE_STALL_SECONDS", 5.0),
        max_attempts=_env_int("CHARLIE_MAX_ATTEMPTS", 5),
        sweep_backlog_limit=_env_int("CHARLIE_SWEEP_BACKLOG_LIMIT", 200),
        sweep_backlog_max_wait=_env_float("CHARLIE_SWEEP_BACKLOG_MAX_WAIT", 120.0),
        sweep_probe_seconds=_env_float("CHARLIE_SWEEP_PROBE_SECONDS", 60.0),
        inline_phases=_env_int("CHARLIE_INLINE_PHASES", 30),
        merge_phases=_env_int("CHARLIE_MERGE_PHASES", 1) > 0,
        fuse_commits=_env_int("CHARLIE_FUSE_COMMITS", 1) > 0,
        local_calls=max(1, _env_int("CHARLIE_LOCAL_CALLS", 8)),
        tool_deadline=_env_float("CHARLIE_TOOL_DEADLINE", 300.0),
        human_deadline=_env_float("CHARLIE_HUMAN_DEADLINE", 86400.0),
        operator=os.environ.get("CHARLIE_OPERATOR", "").strip() or None,
        late_watch_seconds=_env_float("CHARLIE_LATE_WATCH_SECONDS", 3600.0),
        max_result_bytes=_env_int("CHARLIE_MAX_RESULT_BYTES", 256 * 1024),
        max_prompt_bytes=_env_int("CHARLIE_MAX_PROMPT_BYTES", 1024 * 1024),
        report_retries=_env_int("CHARLIE_REPORT_RETRIES", 4),
        model_retry_seconds=_env_float("CHARLIE_MODEL_RETRY_SECONDS", 600.0),
        embedded_poll_interval=_env_float("CHARLIE_EMBEDDED_POLL_INTERVAL", 0.005),
        task_events=task_events,
        devbox_url=os.environ.get("CHARLIE_DEVBOX_URL") or None,
        devbox_token=os.environ.get("CHARLIE_DEVBOX_TOKEN") or None,
        devbox_timeout=_env_float("CHARLIE_DEVBOX_TIMEOUT", 60.0),
        devbox_inline_wait=_env_float("CHARLIE_DEVBOX_INLINE_WAIT", 5.0),
        devbox_poll_interval=_env_float("CHARLIE_DEVBOX_POLL_INTERVAL", 2.0),
        devbox_command_deadline=_env_float("CHARLIE_DEVBOX_COMMAND_DEADLINE", 900.0),
        log_format=_env_choice("CHARLIE_LOG_FORMAT", LOG_FORMATS, "text"),
        intake_queue=os.environ.get("CHARLIE_INTAKE_QUEUE", "celery").strip(),
        remote_control=_env_flag("CHARLIE_REMOTE_CONTROL"),
        sandbox=_env_choice("CHARLIE_SANDBOX", ("bwrap", "off"), "bwrap"),
        sandbox_hide=os.environ.get("CHARLIE_SANDBOX_HIDE", ""),
        sandbox_read=os.environ.get("CHARLIE_SANDBOX_READ", ""),
        sandbox_network=_env_choice(
            "CHARLIE_SANDBOX_NETWORK", ("auto", "pasta", "slirp4netns"), "auto"
        ),
        sandbox_net_deny=os.environ.get("CHARLIE_SANDBOX_NET_DENY", ""),
        workspace_roots=_paths(os.environ.get("CHARLIE_WORKSPACE_ROOTS", "")),
        mcp_config=os.environ.get("CHARLIE_MCP_CONFIG", "").strip() or None,
        mcp_servers=os.environ.get("CHARLIE_MCP_SERVERS", "").strip() or None,
        mcp_timeout=_env_float("CHARLIE_MCP_TIMEOUT", 10.0),
        mcp_retry_seconds=_env_float("CHARLIE_MCP_RETRY_SECONDS", 30.0),
        mcp_max_message_bytes=_env_int("CHARLIE_MCP_MAX_MESSAGE_BYTES", 4 * 1024 * 1024),
        prices=os.environ.get("CHARLIE_PRICES", "").strip() or None,
        model_limits=os.environ.get("CHARLIE_MODEL_LIMITS", "").strip() or None,
        budget_tokens=_env_limit_int("CHARLIE_BUDGET_TOKENS"),
        budget_usd=_env_limit_float("CHARLIE_BUDGET_USD"),
        budget_model_calls=_env_limit_int("CHARLIE_BUDGET_MODEL_CALLS"),
        celery_operator_actions=_env_flag("CHARLIE_CELERY_OPERATOR_ACTIONS", default=True),
        model_retry_after_max=_env_seconds("CHARLIE_MODEL_RETRY_AFTER_MAX", 600.0),
        **_signing(),
        delegate_models=tuple(
            m.strip() for m in os.environ.get("CHARLIE_DELEGATE_MODELS", "").split(",") if m.strip()
        ),
        delegate_max_depth=_env_bound("CHARLIE_DELEGATE_MAX_DEPTH", 3),
        delegate_max_children=_env_bound("CHARLIE_DELEGATE_MAX_CHILDREN", 16),
        model_context_tokens=_env_limit_int("CHARLIE_MODEL_CONTEXT_TOKENS"),
        context_tokens_by_model=_context_overrides(),
        streaming=_env_flag("CHARLIE_STREAMING", default=True),
        stream_url=_stream_url(),
        stream_ttl=_env_float("CHARLIE_STREAM_TTL", 3600.0),
        stream_max_events=max(100, _env_int("CHARLIE_STREAM_MAX_EVENTS", 20000)),
        db_pool_size=_env_at_least_one("CHARLIE_DB_POOL_SIZE", 5),
        db_max_overflow=_env_bound("CHARLIE_DB_MAX_OVERFLOW", 10),
        db_prepare=_env_choice("CHARLIE_DB_PREPARE", ("auto", "on", "off"), "auto"),
        rabbitmq_max_priority=_max_priority(),
        redis_priorities=_env_int("CHARLIE_REDIS_PRIORITIES", 0) > 0,
    )


def _max_priority() -> int:
    value = _env_bound("CHARLIE_RABBITMQ_MAX_PRIORITY", 0)
    if value > 255:
        raise ValueError(
            f"CHARLIE_RABBITMQ_MAX_PRIORITY={value} is above 255, RabbitMQ's most (it advises "
            "at most 10)"
        )
    return value


def _stream_url() -> str | None:
    raw = os.environ.get("CHARLIE_STREAM_URL", "").strip()
    schemes = ("redis://", "rediss://", "unix://", "amqp://", "amqps://", "pyamqp://", "file://")
    if raw and not raw.startswith(schemes):
        raise ValueError(
            "CHARLIE_STREAM_URL must be a redis://, rediss://, unix://, amqp://, amqps:// or "
            f"file:// URL, not {raw.split(':', 1)[0]!r}"
        )
    return raw or None


SIGNING_VARIABLES = (
    "CHARLIE_SECURITY_KEY",
    "CHARLIE_SECURITY_CERTIFICATE",
    "CHARLIE_SECURITY_CERT_STORE",
)


def _signing() -> dict[str, Any]:
    """The message-signing settings: all three files, or none (a half-configured signing
    would publish unsigned, or refuse everything, without saying why)."""
    given = {name: os.environ.get(name, "").strip() for name in SIGNING_VARIABLES}
    missing = [name for name, value in given.items() if not value]
    if len(missing) == len(given):
        return {}
    if missing:
        raise ValueError(
            f"message signing needs {', '.join(SIGNING_VARIABLES)} together; "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set"
        )
    for name in SIGNING_VARIABLES[:2]:
        if not os.path.isfile(given[name]):
            raise ValueError(f"{name}={given[name]!r} is not a readable file")
    return {
        "security_key": given["CHARLIE_SECURITY_KEY"],
        "security_certificate": given["CHARLIE_SECURITY_CERTIFICATE"],
        "security_cert_store": given["CHARLIE_SECURITY_CERT_STORE"],
        "security_key_password": os.environ.get("CHARLIE_SECURITY_KEY_PASSWORD") or None,
    }


@cache
def settings() -> Settings:
    """The process's settings; read once, since every process is configured by its environment."""
    return load_settings()
