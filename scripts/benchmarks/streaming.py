"""``--only streaming``: what streaming for people watching costs.

what streaming for people watching costs (charlie/streams): one run's per-turn overhead
with streaming off, to Redis and to a RabbitMQ stream queue (CHARLIE_STREAM_URL; the worker
restarted for each, trial by trial); and each transport's events/s: 20,000 text deltas of
24 characters emitted through the writer's sink from one process, in bursts of 1,000 each
sent before the next, then read back from the first. Redis at BENCH_STREAM_REDIS_URL
(default the Redis db above), RabbitMQ at BENCH_STREAM_AMQP_URL (default
amqp://guest:guest@127.0.0.1:5672//); one not reachable is skipped and the table says so.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid

from benchmarks.harness import REDIS_URL, Row, progress

STREAM_URLS = {
    "redis": os.environ.get("BENCH_STREAM_REDIS_URL", REDIS_URL),
    "rabbitmq": os.environ.get("BENCH_STREAM_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//"),
}
#: text deltas the events/s figure sends through each transport, and each one's text
STREAM_EVENTS = 20_000
STREAM_DELTA = "x" * 24
STREAM_BURST = 1000


class StreamingFigure:
    """One run's per-turn overhead with streaming off and on; each transport's events/s."""

    def streaming(self) -> None:
        """One run's per-turn overhead with streaming off and on (to each transport reachable),
        the worker restarted for each, interleaved trial by trial; then each transport's
        events/s from this process."""
        reachable = {}
        for name, url in STREAM_URLS.items():
            problem = stream_problem(url)
            if problem:
                self.results.notes.append(f"streaming to {name} not measured: {problem}")
            else:
                reachable[name] = url
        configs = [("off", {"CHARLIE_STREAMING": "0"})] + [
            (name, {"CHARLIE_STREAMING": "1", "CHARLIE_STREAM_URL": url})
            for name, url in reachable.items()
        ]
        try:
            for _ in range(self.sizes.trials):
                for name, env in configs:
                    self.procs.kill("worker")
                    self.start_worker(env)
                    self.warm_up()
                    self.charlie_runs(
                        1, self.sizes.turns_one, f"stream_{name}", f"stream_{name}.turn_ms"
                    )
        finally:
            self.procs.kill("worker")
            self.start_worker()  # the default settings again, for what follows
        for name, url in reachable.items():
            sent, read = stream_rates(url, self.sizes.trials)
            for rate in sent:
                self.results.add(f"stream_{name}.sent_per_s", rate)
            for rate in read:
                self.results.add(f"stream_{name}.read_per_s", rate)
            progress(
                f"{name} stream: {statistics.median(sent):.0f} events/s sent, "
                f"{statistics.median(read):.0f} events/s read"
            )


def stream_problem(url: str) -> str | None:
    """Why the transport at ``url`` cannot be used here, or None."""
    from charlie.streams.open import open_transport

    transport = open_transport(url, ttl=600, max_events=STREAM_EVENTS * 2)
    try:
        transport.append(f"bench-probe-{uuid.uuid4().hex[:8]}", [{"type": "probe"}])
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        transport.close()
    return None


def stream_rates(url: str, trials: int) -> tuple[list[float], list[float]]:
    """Events/s through the transport at ``url``, trial by trial: STREAM_EVENTS text deltas
    emitted through the writer's sink (charlie.streams.sink.TaskEvents, its writer thread
    batching them) until flushed; then read back from the first event, as a late reader."""
    from charlie.streams.open import open_transport
    from charlie.streams.sink import TaskEvents

    sent: list[float] = []
    read: list[float] = []
    for _ in range(trials):
        transport = open_transport(url, ttl=600, max_events=STREAM_EVENTS * 2)
        sink = TaskEvents(transport)
        task_id = f"bench-stream-{uuid.uuid4().hex[:8]}"
        try:
            sink.emit(task_id, "model_start", turn=0, call="0.0.1")
            if not sink.flush(60):
                raise RuntimeError(f"the first event was not sent to {url} within 60 s")
            started = time.perf_counter()
            # in bursts the sink keeps whole (past MAX_QUEUED waiting, it drops deltas), each
            # waited for: what a fast model's stream asks of it, over and over
            for burst in range(0, STREAM_EVENTS, STREAM_BURST):
                for _ in range(min(STREAM_BURST, STREAM_EVENTS - burst)):
                    sink.emit(task_id, "text", turn=0, call="0.0.1", text=STREAM_DELTA)
                if not sink.flush(600):
                    raise RuntimeError(f"{STREAM_EVENTS} events not sent to {url} within 600 s")
            sent.append(STREAM_EVENTS / (time.perf_counter() - started))
            got = 0
            offset = None
            started = time.perf_counter()
            while got < STREAM_EVENTS + 1:
                batch = transport.read(task_id, offset, 5.0)
                if not batch:
                    raise RuntimeError(f"read {got} of {STREAM_EVENTS + 1} events back from {url}")
                got += len(batch)
                offset = batch[-1].offset
            read.append(got / (time.perf_counter() - started))
        finally:
            transport.close()
    return sent, read


ROWS: list[Row | str] = [
    "**Streaming** (events for people watching: 1 run's per-turn overhead with streaming off "
    "and on, the worker restarted for each; events/s of each transport from one process)",
    Row("1 run: per-turn overhead, streaming off (ms)", "stream_off.turn_ms", 1),
    Row("1 run: per-turn overhead, streaming to Redis (ms)", "stream_redis.turn_ms", 1),
    Row("1 run: per-turn overhead, streaming to RabbitMQ (ms)", "stream_rabbitmq.turn_ms", 1),
    Row("Per-turn overhead, Redis streaming / off", "stream_redis.turn_ratio", 2, "≈ 1"),
    Row("Per-turn overhead, RabbitMQ streaming / off", "stream_rabbitmq.turn_ratio", 2, "≈ 1"),
    Row("1 run: ms per turn (wall / turns), streaming off", "stream_off.turn_wall_ms", 1),
    Row("... streaming to Redis", "stream_redis.turn_wall_ms", 1),
    Row("... streaming to RabbitMQ", "stream_rabbitmq.turn_wall_ms", 1),
    Row("Redis: events/s sent (text deltas through the sink)", "stream_redis.sent_per_s"),
    Row("Redis: events/s read back (a late reader)", "stream_redis.read_per_s"),
    Row("RabbitMQ: events/s sent (text deltas through the sink)", "stream_rabbitmq.sent_per_s"),
    Row("RabbitMQ: events/s read back (a late reader)", "stream_rabbitmq.read_per_s"),
]
