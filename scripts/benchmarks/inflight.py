"""``--only inflight``: many agents per worker.

N tasks (``--inflight-tasks``, 1,000; 20 with --quick), each two model calls with an instant
tool call between them, against a real HTTP server on 127.0.0.1 that speaks OpenAI's chat API
(``tests/support/fake_openai.py``) and answers every request after 2 s
(``--inflight-latency``), on ONE worker started as ``charlie worker`` starts by default (a
threads pool of 64; ``--inflight-worker-args`` for another). The wall time from the first submit
to the last task's end, against the ideal (every slot busy from the start: ceil(N / C) x 2
calls x the latency, C the worker's concurrency), the most calls in flight at once as the
provider counted them (its concurrent requests, not a timing), and the worker's RSS (its
process group, the most sampled every 0.5 s). Then the old default, ``--pool prefork -c 2``,
on ``--inflight-prefork`` tasks (60; 2 with --quick: at 2 in flight it is slow by
design). With DBOS (PostgreSQL): the same N agents as DBOS workflows (a model step, a tool step,
a model step: ``scripts/_bench_dbos.py --figure inflight``) on a DBOS queue of the same
concurrency in one process of its own, against the same provider; its RSS is the process's
peak. One pass of each (no trials: the figure is waiting, not CPU).
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
import threading
from typing import Any

from benchmarks.harness import PG_URL, SCRIPTS, Row, progress

#: the model the tasks name: the fake provider behind CHARLIE_MODEL_BASE_URL
MODEL = "openai:bench-model"
#: the calls each task makes (a tool call, then the final answer)
CALLS = 2
#: the old default worker, for the comparison row
PREFORK_ARGS = ["--pool", "prefork", "-c", "2"]


def answer(request: Any) -> Any:
    """The provider's reply: a call of the instant tool, or, once its result is in, an answer."""
    from tests.support.fake_openai import chat_text, chat_tool_calls

    messages = request.body.get("messages", []) if isinstance(request.body, dict) else []
    if any(m.get("role") == "tool" for m in messages if isinstance(m, dict)):
        return chat_text("done")
    return chat_tool_calls([("c1", "bench_echo", '{"value": "x"}')])


def worker_concurrency(worker_args: list[str]) -> int:
    """The slots of a worker started with ``worker_args``, as ``charlie worker`` sets them."""
    from charlie.cli import worker_pool_argv

    argv = [*worker_args, *worker_pool_argv(worker_args)]
    for i, a in enumerate(argv):
        if a in ("-c", "--concurrency") and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--concurrency="):
            return int(a.split("=", 1)[1])
        if a.startswith("-c") and len(a) > 2:
            return int(a[2:])
    return 1


def ideal_seconds(tasks: int, concurrency: int, latency: float) -> float:
    return math.ceil(tasks / concurrency) * CALLS * latency


class InflightFigure:
    """N agents of two slow model calls on one worker; the old default; DBOS the same."""

    def inflight(self) -> None:
        from tests.support.fake_openai import FakeOpenAI

        s = self.sizes
        server = FakeOpenAI().start()
        self.procs.kill("worker")
        try:
            main_args = shlex.split(s.inflight_worker_args)
            if main_args:
                self.results.notes.append(
                    f"inflight: the first worker ran `charlie worker {s.inflight_worker_args}`, "
                    "not as it starts by default"
                )
            self.inflight_charlie(server, "inflight", main_args, s.inflight_tasks)
            self.inflight_charlie(server, "inflight_prefork", PREFORK_ARGS, s.inflight_prefork)
            if self.dbos_python and self.backend.name == "postgres":
                self.inflight_dbos(server, worker_concurrency(main_args))
        finally:
            server.stop()
            self.start_worker()
        self.results.info["inflight.latency_s"] = s.inflight_latency

    def inflight_charlie(self, server: Any, key: str, worker_args: list[str], n: int) -> None:
        from tests.support.fake_openai import ProviderLimit

        latency = self.sizes.inflight_latency
        limit = ProviderLimit(latency=latency, answer=answer)
        server.limit = limit
        env = {
            "CHARLIE_MODEL_BASE_URL": server.url,
            "CHARLIE_MODEL_API_KEY": "bench-key",
            "CHARLIE_MODEL_TIMEOUT": str(max(30.0, 5 * latency)),
        }
        argv = [sys.executable, "-m", "charlie", "worker", *worker_args, "-n", f"{key}@%h"]
        self.procs.spawn("inflight", argv, env)
        try:
            self.wait_ready("inflight")
            rss = [0]
            stop = threading.Event()

            def sample() -> None:
                while not stop.wait(0.5):
                    rss[0] = max(rss[0], self.procs.rss_bytes("inflight"))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            prefix = self.new_prefix(key)
            try:
                self.submit(MODEL, prefix, n)
                self.wait_done(prefix, n, timeout=120 + 4 * n * latency, every=0.5)
            finally:
                stop.set()
                sampler.join()
        finally:
            self.procs.kill("inflight")
        rows = self.transitions(prefix)
        wall = self.wall(prefix, rows)
        concurrency = worker_concurrency(worker_args)
        ideal = ideal_seconds(n, concurrency, latency)
        r = self.results
        r.add(f"{key}.wall_s", wall)
        r.add(f"{key}.ideal_s", ideal)
        r.add(f"{key}.vs_ideal", wall / ideal)
        r.add(f"{key}.peak", limit.peak)
        r.add(f"{key}.rss_mib", rss[0] / 2**20)
        progress(
            f"{key}: {n} tasks on `{' '.join(['charlie worker', *worker_args])}` "
            f"({concurrency} slots):"
            f" {wall:.1f} s (ideal {ideal:.0f} s), peak {limit.peak} in flight, "
            f"RSS {rss[0] / 2**20:.0f} MiB"
        )

    def inflight_dbos(self, server: Any, concurrency: int) -> None:
        """The same agents as DBOS workflows on a queue, in a process of its own."""
        from tests.support.fake_openai import ProviderLimit

        s = self.sizes
        limit = ProviderLimit(latency=s.inflight_latency, answer=answer)
        server.limit = limit
        argv = [str(self.dbos_python), str(SCRIPTS / "_bench_dbos.py"), "--figure", "inflight"]
        argv += ["--database-url", f"{PG_URL}_dbos", "--model-url", server.url]
        argv += ["--tasks", str(s.inflight_tasks), "--concurrency", str(concurrency)]
        timeout = 300 + 4 * s.inflight_tasks * s.inflight_latency
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=True)
            doc = json.loads(done.stdout.strip().splitlines()[-1])
        except subprocess.CalledProcessError as exc:
            tail = (exc.stderr or "").strip().splitlines()[-3:]
            self.results.notes.append(f"inflight: the DBOS run failed: {' / '.join(tail)}")
            return
        except (subprocess.SubprocessError, ValueError, IndexError) as exc:
            self.results.notes.append(f"inflight: the DBOS run failed: {exc}")
            return
        ideal = ideal_seconds(s.inflight_tasks, concurrency, s.inflight_latency)
        r = self.results
        r.info["dbos"] = doc["version"]
        r.add("inflight_dbos.wall_s", doc["wall_s"])
        r.add("inflight_dbos.ideal_s", ideal)
        r.add("inflight_dbos.vs_ideal", doc["wall_s"] / ideal)
        r.add("inflight_dbos.peak", limit.peak)
        r.add("inflight_dbos.rss_mib", doc["rss_mib"])
        walls = r.values.get("inflight.wall_s")
        if walls:
            r.add("inflight.vs_dbos", walls[-1] / doc["wall_s"])
        progress(
            f"inflight: DBOS {doc['version']}, {s.inflight_tasks} agents on a queue of "
            f"{concurrency}: {doc['wall_s']:.1f} s, peak {limit.peak}, RSS {doc['rss_mib']:.0f} MiB"
        )


ROWS: list[Row | str] = [
    "**Many agents per worker** (N tasks of two 2-s model calls, one worker)",
    Row("`charlie worker` as started (threads, 64): wall s", "inflight.wall_s", 1),
    Row("... ideal s (ceil(N / slots) x 2 calls x latency)", "inflight.ideal_s", 1),
    Row("... wall / ideal", "inflight.vs_ideal", 2),
    Row("... peak calls in flight (the provider's count)", "inflight.peak"),
    Row("... worker RSS, most sampled (MiB)", "inflight.rss_mib"),
    Row("Prefork, 2 processes (the old default): wall s", "inflight_prefork.wall_s", 1),
    Row("... ideal s", "inflight_prefork.ideal_s", 1),
    Row("... peak calls in flight", "inflight_prefork.peak"),
    Row("... worker RSS (MiB)", "inflight_prefork.rss_mib"),
    Row("DBOS, the same N agents from a queue, one process: wall s", "inflight_dbos.wall_s", 1),
    Row("... wall / ideal", "inflight_dbos.vs_ideal", 2),
    Row("... peak calls in flight", "inflight_dbos.peak"),
    Row("... process RSS, peak (MiB)", "inflight_dbos.rss_mib"),
    Row("Charlie wall / DBOS wall", "inflight.vs_dbos", 2),
]
