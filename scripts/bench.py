#!/usr/bin/env python
"""Charlie's benchmark: what a transition and a turn cost, side by side with the floor.

    python scripts/bench.py                  # every reachable backend, 3 trials
    python scripts/bench.py --quick          # a smoke run: 1 trial, small sizes
    python scripts/bench.py --backend postgres --only transitions,floor --trials 5
    python scripts/bench.py --backend postgres --only inflight,fleet --trials 3

For each backend (SQLite + the embedded broker in a fresh CHARLIE_HOME; PostgreSQL + Redis on
127.0.0.1, database ``charlie_bench`` and Redis db 14, both wiped first), it starts one Charlie
worker (``charlie worker -c 2 --pool prefork``: 2 worker processes) and ``charlie beat`` with
the default settings and measures:

transitions
    scripted tasks of T turns, each turn one instant tool call and an instant model, for 1 run
    and for 50 concurrent runs. A transition is a row of the ``transitions`` table; the rate is
    rows / (last transition - first submit); ms/transition is 1000 / rate (for one run, the
    latency of a transition; for 50, its amortised cost). Per-turn overhead: from the commit of
    a model response (call_model -> dispatch_tools) to the start of the next model call's tick
    (the next call_model transition's time minus its duration).
floor
    a bare Celery chain (``scripts/_bench_floor.py``), in the same run on the same broker and
    database with the same Celery settings, whose every link locks one row, updates it, commits
    and publishes the next link. Charlie / floor compares transitions/s with links/s, trial by
    trial (trials interleave Charlie and floor runs).
fanout
    one turn of 100 instant tool calls: model response to next model call, and SQL statements
    per tool call, counted inside the workers (``scripts/_bench_support.py``).
recovery
    SIGKILL of the whole worker while model calls are in flight (a scripted model that sleeps),
    a new worker started at once; time from the kill to the run moving again (the retried model
    call's tick starting), with the default lease and sweep settings and beat running.
scale
    N queued tasks (one turn each) drained by a fresh worker: transitions/s against the 50-run
    figure, the worker's resident memory (sum over its process group), database bytes per task.
waiting
    N tasks (1,000; 100 with --quick) whose first turn calls a tool on their ``approve`` list,
    so they wait for a person (I25): the per-turn overhead of 1 run and the rate of a batch of
    runs, without and then with the N waiting; meanwhile, what the N hold (leases, started
    calls), their transitions, the sweeps' re-publishes and scans, the broker queue. Then every
    held call is approved and the N timed to the end.
longrun
    one run of 200 turns, each a tool call with a 4 KiB result (800 KiB in all), its scripted
    model given a context window of 16,000 tokens (CHARLIE_MODEL_<NAME>_CONTEXT_TOKENS): the
    largest model input (characters of content / 4, as the model's ledger saw it) against the
    window, the compactions made, and the turn time (call_model's commit to the next one's:
    the input's assembly included) and call_model's own tick, medians over turns 5-55 and
    150-200; then the same run with no window
    (every input the whole transcript), for comparison.
streaming
    what streaming for people watching costs (charlie/streams): one run's per-turn overhead
    with streaming off, to Redis and to a RabbitMQ stream queue (CHARLIE_STREAM_URL; the worker
    restarted for each, trial by trial); and each transport's events/s: 20,000 text deltas of
    24 characters emitted through the writer's sink from one process, in bursts of 1,000 each
    sent before the next, then read back from the first. Redis at BENCH_STREAM_REDIS_URL
    (default the Redis db above), RabbitMQ at BENCH_STREAM_AMQP_URL (default
    amqp://guest:guest@127.0.0.1:5672//); one not reachable is skipped and the table says so.
console
    the run console (``charlie ui``) on a real run of 2,000 transcript items (scripted turns of
    a message and four instant tool calls): the task page's server time over HTTP, its live
    fragment and revision read, and the time to a usable page in headless Chromium (Selenium,
    Debian's chromium + chromium-driver; the load event: the page parsed, styled and its
    script running); then the list's first page, a page deep in it, a status filter and a
    search, over 100,000 tasks inserted directly with SQL.

limits
    provider limits the fleet keeps (CHARLIE_MODEL_LIMITS): a real HTTP server on 127.0.0.1
    (``tests/support/fake_openai.py``) that allows 4 requests in flight and 600 a minute and
    refuses any more with 429 and retry-after, as OpenAI does; 200 one-call tasks through a
    worker of 6 processes with the same limits declared: the provider's refusals, and the
    throughput against what the provider allows (4 in flight / its latency, 0.5 s or
    ``BENCH_LIMITS_LATENCY``: 200 requests stay under the 600 a minute). Then the limiter's
    own cost per model call, uncontended, in this process: the statements and milliseconds of
    taking and releasing a slot.

inflight
    many agents per worker: N tasks (``--inflight-tasks``, 1,000; 20 with --quick) of two
    model calls each (an instant tool call between them) against a real HTTP server on
    127.0.0.1 that answers every request after 2 s (``--inflight-latency``), on ONE worker
    started as ``charlie worker`` starts by default (threads, 64): the wall time against the
    ideal (ceil(N / slots) x 2 calls x the latency), the most calls in flight as the server
    counted them, the worker's RSS; then the old default (``--pool prefork -c 2``) on
    ``--inflight-prefork`` tasks (60; 2 with --quick); with DBOS, the same N agents on a DBOS
    queue of the same concurrency in one process (``scripts/_bench_dbos.py --figure inflight``).
fleet
    ``--fleet-runs`` runs at once (50; 20 with --quick), each ``--fleet-turns`` turns (20; 2
    with --quick) of one instant tool call, on ONE worker as ``charlie worker`` starts by
    default: turns per second and WAL bytes per turn (``pg_current_wal_lsn`` over the run,
    the whole server's); with DBOS, trial by trial, the same workflows (a model step and a
    tool step per turn) enqueued at once on a DBOS queue (``--figure fleet``).

sandbox start (``--sandbox-start N``, alone: no backend, no worker)
    what the local ``run_command`` costs before the command does anything: a sandboxed ``true``
    run N times through the tool itself (bubblewrap, the allow-list's binds, the environment
    set inside), the median in ms; and the same for a task allowed the network (its own
    network namespace behind the user-mode stack) where one works here.

Each backend runs in a child process of its own (Charlie reads its settings once per process),
one after the other; ``--quick`` is a smoke run whose figures nobody judges, so its backends run
side by side to stay under a minute. ``--dbos-python PYTHON`` (an interpreter with ``dbos``)
adds DBOS on the PostgreSQL round: the same two steps per turn as a DBOS workflow
(``scripts/_bench_dbos.py``). ``--worker-env KEY=VALUE`` runs the workers with a
non-default setting, for experiments (the table then says so). Every process the benchmark
starts runs in its own process group and is killed on exit, Ctrl-C included.

The code is the package ``scripts/benchmarks/``: one module per figure above (``transitions``,
``floor``, ``dbos``, ``fanout``, ``recovery``, ``scale``, ``waiting``, ``streaming``,
``console``, ``longrun``, ``limits``, ``inflight``, ``fleet``, ``growth``, ``sandbox_start``),
each a mixin of the methods that measure it and the table's rows it fills; ``harness``
(backends, processes, storage, statistics, a backend run's base), ``table`` (the rows in order,
derived ratios, the rendering) and ``runner`` (the parent, the children, the options).
docs/benchmarks.md says how to add one.
"""

from __future__ import annotations

import sys

from benchmarks.runner import main

if __name__ == "__main__":
    sys.exit(main())
