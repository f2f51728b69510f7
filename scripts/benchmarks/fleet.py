"""``--only fleet``: 50 runs at once on one worker, against DBOS's 50 workflows on a queue.

``--fleet-runs`` runs (50; 20 with --quick) submitted at once, each a task of ``--fleet-turns``
turns (20; 2 with --quick), each turn one instant tool call and an instant model (the task of
``--only transitions``), on ONE worker started as ``charlie worker`` starts by default (threads,
64; ``--fleet-worker-args`` for another): turns per second (all turns / the wall from the first
submit to the last transition) and, on PostgreSQL, WAL bytes per turn (``pg_current_wal_lsn``
before the submits and after the last run ends, divided by the turns: the whole server's WAL,
beat's sweeps and anything else on the server included). With DBOS (PostgreSQL), trial by
trial: the same runs as DBOS workflows of a model step and a tool step per turn, enqueued at
once on a DBOS queue in one process on the same server (``scripts/_bench_dbos.py --figure
fleet``), measured the same way; the ratios are taken trial by trial.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

from benchmarks.harness import PG_ADMIN, PG_URL, SCRIPTS, Row, progress


class FleetFigure:
    """Many runs at once: turns/s and WAL bytes per turn, Charlie and DBOS."""

    def fleet(self) -> None:
        s = self.sizes
        self.procs.kill("worker")  # the runs are the fleet worker's alone
        argv = [sys.executable, "-m", "charlie", "worker", *shlex.split(s.fleet_worker_args)]
        self.procs.spawn("fleet", [*argv, "-n", "fleet@%h"])
        if s.fleet_worker_args:
            self.results.notes.append(
                f"fleet: the worker ran `charlie worker {s.fleet_worker_args}`, not as it "
                "starts by default"
            )
        try:
            self.wait_ready("fleet")
            warm = self.new_prefix("fleetwarm")
            self.submit(self.turns_script(1), warm, 4)
            self.wait_done(warm, 4, timeout=120)
            for _ in range(s.trials):
                self.fleet_charlie()
                if self.dbos_python and self.backend.name == "postgres":
                    self.fleet_dbos()
        finally:
            self.procs.kill("fleet")
            self.start_worker()

    def wal_position(self) -> int | None:
        """The server's WAL write position in bytes (PostgreSQL only)."""
        if self.backend.name != "postgres":
            return None
        import psycopg

        with psycopg.connect(**PG_ADMIN, autocommit=True) as conn:  # type: ignore[arg-type]
            row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
        assert row is not None
        return int(row[0])

    def fleet_charlie(self) -> None:
        s = self.sizes
        runs, turns = s.fleet_runs, s.fleet_turns
        model = self.turns_script(turns)
        prefix = self.new_prefix("fleet")
        lsn0 = self.wal_position()
        self.submit(model, prefix, runs)
        self.wait_done(prefix, runs, timeout=60 + runs * turns * 0.5)
        lsn1 = self.wal_position()
        rows = self.transitions(prefix)
        wall = self.wall(prefix, rows)
        all_turns = runs * turns
        r = self.results
        r.add("fleet.turns_per_s", all_turns / wall)
        r.add("fleet.turn_ms", wall * 1000 / all_turns)
        message = f"fleet: Charlie, {runs} x {turns} turns: {all_turns / wall:.0f} turns/s"
        if lsn0 is not None and lsn1 is not None:
            r.add("fleet.wal_bytes_per_turn", (lsn1 - lsn0) / all_turns)
            message += f", {(lsn1 - lsn0) / all_turns:,.0f} WAL bytes per turn"
        progress(message)

    def fleet_dbos(self) -> None:
        s = self.sizes
        argv = [str(self.dbos_python), str(SCRIPTS / "_bench_dbos.py"), "--figure", "fleet"]
        argv += ["--database-url", f"{PG_URL}_dbos"]
        argv += ["--runs", str(s.fleet_runs), "--runs-turns", str(s.fleet_turns)]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True)
            doc = json.loads(done.stdout.strip().splitlines()[-1])
        except subprocess.CalledProcessError as exc:
            tail = (exc.stderr or "").strip().splitlines()[-3:]
            self.results.notes.append(f"fleet: the DBOS run failed: {' / '.join(tail)}")
            return
        except (subprocess.SubprocessError, ValueError, IndexError) as exc:
            self.results.notes.append(f"fleet: the DBOS run failed: {exc}")
            return
        r = self.results
        r.info["dbos"] = doc["version"]
        r.add("fleet_dbos.turns_per_s", doc["turns_per_s"])
        r.add("fleet_dbos.turn_ms", doc["wall_s"] * 1000 / doc["turns"])
        r.add("fleet_dbos.wal_bytes_per_turn", doc["wal_bytes_per_turn"])
        for ratio, key in (
            ("fleet.tps_vs_dbos", "turns_per_s"),
            ("fleet.wal_vs_dbos", "wal_bytes_per_turn"),
        ):
            ours = r.values.get(f"fleet.{key}")
            if ours and doc[key]:
                r.add(ratio, ours[-1] / doc[key])
        progress(
            f"fleet: DBOS {doc['version']}, {s.fleet_runs} x {s.fleet_turns} turns on a queue: "
            f"{doc['turns_per_s']:.0f} turns/s, {doc['wal_bytes_per_turn']:,.0f} WAL bytes per turn"
        )


ROWS: list[Row | str] = [
    "**Fleet** (many runs at once on one worker as started; each turn an instant tool call)",
    Row("Charlie: turns/s", "fleet.turns_per_s"),
    Row("Charlie: ms per turn (wall / all turns)", "fleet.turn_ms", 2),
    Row("Charlie: WAL bytes per turn (whole server)", "fleet.wal_bytes_per_turn"),
    Row("DBOS, the same workflows on a queue: turns/s", "fleet_dbos.turns_per_s"),
    Row("DBOS: ms per turn (wall / all turns)", "fleet_dbos.turn_ms", 2),
    Row("DBOS: WAL bytes per turn (whole server)", "fleet_dbos.wal_bytes_per_turn"),
    Row("Charlie / DBOS turns/s", "fleet.tps_vs_dbos", 2),
    Row("... trial by trial", "fleet.tps_vs_dbos", 2, "", "all"),
    Row("Charlie / DBOS WAL bytes per turn", "fleet.wal_vs_dbos", 2),
    Row("... trial by trial", "fleet.wal_vs_dbos", 2, "", "all"),
]
