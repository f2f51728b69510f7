"""Many agents per worker: N tasks, each one model call that a fake provider answers after
``--latency`` seconds, on ONE worker started as `charlie worker` starts by default (or with
``--worker-args``). Prints the wall time against the ideal (every call at once: the latency;
with the worker's concurrency C: ceil(N / C) x latency), the most calls in flight at once as the
provider counted them (its concurrent requests, not a timing), and the worker's RSS (its
process group, sampled while the calls wait). ``--dbos``: DBOS runs the same N agents from a
queue of the same concurrency in one process against the same provider, side by side (needs the
``dbos`` package and PostgreSQL).

A standalone script, with its own argparse and main, that the benchmark package can adopt as a
figure of its own later:

    python scripts/bench_inflight.py --inflight-tasks 1000
    python scripts/bench_inflight.py --inflight-tasks 300 --database-url postgresql://... \\
        --broker-url redis://127.0.0.1:6379/0 --dbos
    python scripts/bench_inflight.py --worker-args "--pool prefork -c 2"   # the old default
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.cluster import (  # noqa: E402
    Backend,
    Cluster,
    cluster_env,
    flush_redis,
    free_port,
    recreate_postgres_database,
)
from tests.support.fake_openai import (  # noqa: E402
    FakeOpenAI,
    ProviderLimit,
    Recorded,
    Reply,
    chat_text,
)

MODEL = "openai:fake-model"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inflight-tasks", type=int, default=1000, help="tasks (one model call each)")
    p.add_argument("--latency", type=float, default=2.0, help="seconds the provider takes")
    p.add_argument(
        "--worker-args",
        default="",
        help="arguments for `charlie worker` (default: none, as it starts by default)",
    )
    p.add_argument("--database-url", default=None, help="default: SQLite in a temp home")
    p.add_argument("--broker-url", default=None, help="default: the embedded broker")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--dbos", action="store_true", help="DBOS side by side (PostgreSQL only)")
    p.add_argument("--dbos-python", default=sys.executable, help="an interpreter with dbos")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--as-dbos", default=None, help=argparse.SUPPRESS)  # the DBOS child
    return p.parse_args()


def _answer(_: Recorded) -> Reply:
    return Reply(200, chat_text("done").body)


def _group_rss(pgid: int) -> int:
    """The resident bytes of every process of a process group (a worker and its children)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pgid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue
    return total


def _concurrency(worker_args: list[str]) -> int:
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


def run_charlie(args: argparse.Namespace, server: FakeOpenAI) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="charlie-inflight-"))
    backend = Backend("inflight", args.database_url, args.broker_url)
    env = cluster_env(home, backend, model_port=server.port)
    env["CHARLIE_MODEL_TIMEOUT"] = str(max(30.0, 5 * args.latency))
    for key in [k for k in os.environ if k.startswith("CHARLIE_")]:
        del os.environ[key]
    os.environ.update(env)
    if args.database_url and args.database_url.startswith("postgresql"):
        recreate_postgres_database(args.database_url)
    if args.broker_url and args.broker_url.startswith("redis"):
        flush_redis(args.broker_url)

    import charlie
    from charlie.config import settings
    from charlie.store.engine import upgrade

    upgrade(settings().database_url)
    worker_args = shlex.split(args.worker_args)
    cluster = Cluster(home=home, backend=backend, settings_env=env)
    cluster.set_faults({})
    limit = ProviderLimit(latency=args.latency, answer=_answer)
    server.limit = limit
    with cluster.without_workers():
        proc = cluster._spawn(["worker", *worker_args, "-n", "inflight@%h"], "worker.log")
        cluster.workers.append(proc)
        deadline = time.monotonic() + 120
        log = home / "worker.log"
        while " ready." not in (log.read_text(errors="replace") if log.exists() else ""):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"the worker did not start: see {log}")
            time.sleep(0.2)
        rss = [0]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.5):
                rss[0] = max(rss[0], _group_rss(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        ids = [charlie.submit(f"agent {i}", model=MODEL) for i in range(args.inflight_tasks)]
        statuses: dict[str, int] = {}
        for task_id in ids:
            left = max(1.0, args.timeout - (time.monotonic() - started))
            status = charlie.wait(task_id, timeout=left).status.value
            statuses[status] = statuses.get(status, 0) + 1
        wall = time.monotonic() - started
        stop.set()
        sampler.join()
    concurrency = _concurrency(worker_args)
    return {
        "system": "charlie",
        "worker": "charlie worker " + " ".join(worker_args + ["(defaults)"] * (not worker_args)),
        "tasks": args.inflight_tasks,
        "concurrency": concurrency,
        "wall_s": round(wall, 2),
        "ideal_s": round(math.ceil(args.inflight_tasks / concurrency) * args.latency, 2),
        "peak_in_flight": limit.peak,
        "rss_mib": round(rss[0] / 2**20, 1),
        "statuses": statuses,
    }


def run_dbos(args: argparse.Namespace, server: FakeOpenAI, concurrency: int) -> dict[str, Any]:
    """DBOS in a process of its own (its RSS its own), against the same provider."""
    assert args.database_url and args.database_url.startswith("postgresql"), "DBOS: PostgreSQL"
    limit = ProviderLimit(latency=args.latency, answer=_answer)
    server.limit = limit
    from sqlalchemy.engine import make_url

    url = make_url(args.database_url)
    dbos_url = url.set(database=f"{url.database}_dbos").render_as_string(False)
    done = subprocess.run(
        [
            args.dbos_python,
            __file__,
            "--as-dbos",
            json.dumps(
                {
                    "url": dbos_url,
                    "model_url": server.url,
                    "tasks": args.inflight_tasks,
                    "concurrency": concurrency,
                }
            ),
        ],
        capture_output=True,
        text=True,
        timeout=args.timeout,
        check=False,
    )
    if done.returncode != 0:
        return {"system": "dbos", "error": done.stderr.strip().splitlines()[-1:]}
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    out.update(
        tasks=args.inflight_tasks,
        concurrency=concurrency,
        ideal_s=round(math.ceil(args.inflight_tasks / concurrency) * args.latency, 2),
        peak_in_flight=limit.peak,
    )
    return out


def dbos_child(spec: dict[str, Any]) -> None:
    """The same agents as DBOS workflows on a queue of the same concurrency, in this process."""
    import resource
    from importlib.metadata import version

    import httpx
    from dbos import DBOS, Queue

    sys.path.insert(0, str(REPO / "scripts"))
    from _bench_dbos import recreate

    recreate(spec["url"])
    DBOS(config={"name": "charlie-bench-inflight", "system_database_url": spec["url"]})
    queue = Queue("agents", concurrency=spec["concurrency"])
    client = httpx.Client(timeout=60, limits=httpx.Limits(max_connections=spec["concurrency"]))

    @DBOS.step()
    def model_step(prompt: str) -> str:
        body = {"model": "fake-model", "messages": [{"role": "user", "content": prompt}]}
        reply = client.post(spec["model_url"] + "/chat/completions", json=body)
        reply.raise_for_status()
        return str(reply.json()["choices"][0]["message"]["content"])

    @DBOS.workflow()
    def agent(prompt: str) -> str:
        return model_step(prompt)

    DBOS.launch()
    try:
        started = time.monotonic()
        handles = [queue.enqueue(agent, f"agent {i}") for i in range(spec["tasks"])]
        for handle in handles:
            handle.get_result()
        wall = time.monotonic() - started
    finally:
        DBOS.destroy()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps(
            {
                "system": f"dbos {version('dbos')}",
                "worker": "one process, a queue",
                "wall_s": round(wall, 2),
                "rss_mib": round(rss / 2**20, 1),
            }
        )
    )


def main() -> int:
    args = parse_args()
    if args.as_dbos:
        dbos_child(json.loads(args.as_dbos))
        return 0
    server = FakeOpenAI(port=free_port()).start()
    try:
        rows = [run_charlie(args, server)]
        if args.dbos:
            rows.append(run_dbos(args, server, int(rows[0]["concurrency"])))
    finally:
        server.stop()
    if args.json:
        print(json.dumps(rows))
        return 0
    print(
        f"{args.inflight_tasks} tasks, one {args.latency:g}-s model call each, one worker "
        f"(load average {os.getloadavg()[0]:.1f}: on a loaded machine, report as loaded)"
    )
    print(f"{'system':<10} {'wall s':>8} {'ideal s':>8} {'peak':>6} {'RSS MiB':>8}  worker")
    for row in rows:
        if "error" in row:
            print(f"{row['system']:<10} error: {row['error']}")
            continue
        print(
            f"{row['system']:<10} {row['wall_s']:>8} {row['ideal_s']:>8} "
            f"{row['peak_in_flight']:>6} {row['rss_mib']:>8}  {row['worker']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
