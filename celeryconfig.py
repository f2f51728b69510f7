"""Celery settings for Charlie workers, beat and producers.

Every setting says why: the database is the source of truth, so the broker only has to deliver
ticks at least once, and a phase task is safe to run twice, concurrently, late or never
(docs/invariants.md, I2 and I4).
"""

from datetime import timedelta

from charlie import broker, home
from charlie.config import REDIS_PRIORITY_STEPS, SWEEP_QUEUE, TICK_QUEUE, settings

_s = settings()

broker_url = _s.broker_url
if _s.is_embedded_broker:
    broker.register()
    home.prepare(_s.home)  # private (0700): the broker's messages carry prompts and results
    broker_transport_options = broker.transport_options(_s.broker_dir, _s.embedded_poll_interval)
else:
    broker_transport_options = {
        # Far above any tick: an unacknowledged Redis message is re-delivered after this, even
        # while a worker still runs it. Ticks are bounded well below it; long waits are stored
        # in the database, never as countdowns.
        "visibility_timeout": 6 * 3600,
        # Workers have stopped consuming after a silent Redis reconnect (celery#8030).
        "socket_keepalive": True,
        "health_check_interval": 10,
    }
    if _s.is_redis_broker:
        # Message priorities (a task's submit(priority=...), config.broker_priority): kombu
        # keeps a list per step (`charlie`, `charlie\x06\x163`, ...6, ...9) and a worker's
        # BRPOP names every queue's step-0 list first, then every queue's step-3 list..., so a
        # lower step is taken first whatever the queue order strategy (left round robin: the
        # sweeps' and the intake queue's turns stay fair). Kombu's default steps and separator,
        # said here so they cannot drift: a worker of an earlier release, started without
        # them, consumes the same four lists during a rolling upgrade.
        broker_transport_options["priority_steps"] = list(REDIS_PRIORITY_STEPS)
        broker_transport_options["sep"] = "\x06\x16"
    if _s.is_rabbitmq and _s.rabbitmq_max_priority:
        # CHARLIE_RABBITMQ_MAX_PRIORITY: the tick queue declared with x-max-priority, as Celery
        # declares it otherwise (its exchange and routing key are its name). Only that queue:
        # the sweeps' and the intake queue keep their arguments (redeclaring a queue with other
        # arguments is refused, PRECONDITION_FAILED, and the intake's messages, unlike ticks,
        # are not re-published by any sweep).
        from kombu import Exchange, Queue

        task_queues = (
            Queue(
                TICK_QUEUE,
                Exchange(TICK_QUEUE),
                routing_key=TICK_QUEUE,
                queue_arguments={"x-max-priority": _s.rabbitmq_max_priority},
            ),
        )

# A message a worker's task publishes without a priority of its own takes the priority of the
# message that task came from: the await tick a settled call publishes is its run's, whose
# priority the invocation carried (runtime.Publisher), without a read to learn it.
task_inherit_parent_priority = True

# Nothing calls .get(): the database holds every outcome.
result_backend = None
task_ignore_result = True

task_serializer = "json"
accept_content = ["json"]
if _s.signs_messages:
    # Celery's message signing (CHARLIE_SECURITY_*): every message this process publishes (a
    # producer's submit, a worker's next tick, the beat's re-publish) is signed with its key,
    # and a worker takes only task messages signed by a certificate in the store; an unsigned
    # or forged one is refused before any task runs. charlie/app.py calls setup_security().
    task_serializer = "auth"
    accept_content = ["auth"]
    security_key = _s.security_key
    security_certificate = _s.security_certificate
    security_cert_store = _s.security_cert_store
    security_key_password = _s.security_key_password.encode() if _s.security_key_password else None

# Acknowledge after the task ran, and give a message back when its worker dies, so a killed
# worker's tick is redelivered where the broker can; the database counts attempts, so a message
# that kills its worker every time stops after CHARLIE_MAX_ATTEMPTS (poison messages).
task_acks_late = True
task_reject_on_worker_lost = True
# One message at a time per process: a prefetched tick would sit behind a slow model call.
worker_prefetch_multiplier = 1
# After a broker reconnect, late-ack tasks may be redelivered while still running; stop them.
worker_cancel_long_running_tasks_on_connection_loss = True
broker_connection_retry_on_startup = True

# Phase ticks and tool invocations share one queue, so a busy turn cannot starve the loop.
# Sweeps have their own: recovery must not wait behind the backlog it is there to clear.
# `charlie worker` consumes both, and Celery's default queue (`celery`, CHARLIE_INTAKE_QUEUE),
# where a producer that has only Celery and no routing sends `charlie.submit`; operators may
# also run a small worker for sweeps alone.
task_default_queue = TICK_QUEUE
task_routes = {"charlie.sweep.*": {"queue": SWEEP_QUEUE}}

# Remote control (inspect, ping, broadcasts) only when asked for (CHARLIE_REMOTE_CONTROL=1, for
# Flower's worker pages): anyone who can publish to the broker could use it. Never on the
# embedded broker, where a dead worker's broadcast queue is never removed and every later
# broadcast would leave a file behind for it.
worker_enable_remote_control = _s.remote_control and not _s.is_embedded_broker

# Flower shows the loop as it runs (I21): each phase is its own task name.
worker_send_task_events = _s.task_events
task_send_sent_event = _s.task_events

# Hard limit on any single task: ticks are short; model calls and tools renew leases, and a
# stuck one is killed here rather than holding a worker forever.
task_time_limit = 3600
task_soft_time_limit = 3300

worker_hijack_root_logger = False
worker_redirect_stdouts = False

beat_schedule_filename = str(_s.home / "celerybeat-schedule")
_every = timedelta(seconds=_s.sweep_interval)
# A sweep still queued after this is dropped: a newer one is behind it.
_expires = max(10.0, _s.sweep_interval * 5)
beat_schedule = {
    "charlie-sweep-stalled": {
        "task": "charlie.sweep.stalled_runs",
        "schedule": _every,
        "options": {"expires": _expires},
    },
    "charlie-sweep-tool-calls": {
        "task": "charlie.sweep.tool_calls",
        "schedule": _every,
        "options": {"expires": _expires},
    },
    "charlie-sweep-timeouts": {
        "task": "charlie.sweep.task_timeouts",
        "schedule": _every,
        "options": {"expires": _expires},
    },
}
