"""``--only floor``: a bare Celery chain on the same broker and database, the floor.

a bare Celery chain (``scripts/_bench_floor.py``), in the same run on the same broker and
database with the same Celery settings, whose every link locks one row, updates it, commits
and publishes the next link. Charlie / floor compares transitions/s with links/s, trial by
trial (trials interleave Charlie and floor runs).
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from benchmarks.harness import progress

if TYPE_CHECKING:
    from sqlalchemy import Engine


class FloorFigure:
    """The floor's worker and its chains (``scripts/_bench_floor.py``)."""

    def start_floor_worker(self) -> None:
        argv = [sys.executable, "-m", "celery", "-A", "_bench_floor", "worker", "--loglevel"]
        argv += ["INFO", "-Q", "bench_floor", "-c", "2", "--pool", "prefork", "-n", "floor@%h"]
        if self.backend.embedded:
            argv += ["--without-gossip", "--without-mingle"]  # as `charlie worker` does
        self.procs.spawn("floor", argv)

    def warm_up_floor(self) -> None:
        self.floor_chains(4, 3, record=None)

    def floor_chains(self, chains: int, links: int, record: str | None) -> float:
        import _bench_floor
        from sqlalchemy import text

        eng = self.floor_engine()
        prefix = self.new_prefix(record or "warm")
        ids = [f"{prefix}{n:04d}" for n in range(chains)]
        _bench_floor.start_chains(eng, ids, links)
        deadline = time.monotonic() + 60 + chains * links * 0.2
        table = _bench_floor.TABLE
        while True:
            with eng.connect() as conn:
                row = conn.execute(
                    text(
                        f"SELECT COUNT(done_at), MIN(started_at), MAX(done_at) FROM {table} "
                        "WHERE id LIKE :p"
                    ),
                    {"p": f"{prefix}%"},
                ).one()
            if row[0] >= chains:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"floor: {row[0]}/{chains} chains done")
            time.sleep(0.25)
        rate = float(chains * links / (row[2] - row[1]))
        progress(f"floor, {chains} x {links} links: {rate:.0f} links/s")
        if record:
            self.results.add(f"{record}.tps", rate)
            self.results.add(f"{record}.ms", 1000 / rate)
        return rate

    def floor_engine(self) -> Engine:
        import _bench_floor

        if self.floor_db is None:
            self.floor_db = _bench_floor.make_engine(self.floor_url)
            _bench_floor.create_table(self.floor_db)
        return self.floor_db
