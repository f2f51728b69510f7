"""Fault kind: SIGKILL of a random worker's whole process group every few seconds (a supervisor
restarts it), with a snapshot of what its processes held when killed: the calls and runs the
checkers then follow to an interrupted, reconciled or observed-again end (I10).
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

from tests.support.cluster import Cluster


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return pids


class Killer(threading.Thread):
    def __init__(self, cluster: Cluster, every: float, rng: random.Random) -> None:
        super().__init__(daemon=True, name="killer")
        self.cluster, self.every, self.rng = cluster, every, rng
        self.stop = threading.Event()
        self.kills: list[tuple[float, set[int]]] = []
        #: what each kill caught: (kill time, kind, execution id, turn, call id)
        self.held: list[tuple[float, str, str, int, str]] = []

    def snapshot(self, pids: set[int], at: float) -> None:
        """What the killed worker held: run leases and call leases (the work to recover)."""
        from sqlalchemy import select

        from charlie.runtime import get_runtime
        from charlie.store.engine import read
        from charlie.store.schema import executions, tool_calls

        def mine(owner: str | None) -> bool:
            return bool(owner) and int(str(owner).rsplit(":", 1)[1]) in pids

        e, c = executions.c, tool_calls.c
        with read(get_runtime().engine) as conn:
            for row in conn.execute(select(e.id, e.lease_owner).where(e.lease_owner.is_not(None))):
                if mine(row.lease_owner):
                    self.held.append((at, "run", row.id, 0, ""))
            for row in conn.execute(
                select(c.execution_id, c.turn, c.call_id, c.lease_owner).where(
                    c.state == "started", c.lease_owner.is_not(None)
                )
            ):
                if mine(row.lease_owner):
                    self.held.append((at, "call", row.execution_id, row.turn, row.call_id))

    def run(self) -> None:
        while not self.stop.wait(self.every):
            alive = self.cluster.alive_workers()
            if not alive:
                continue
            victim = self.rng.choice(alive)
            pids = set(group_pids(victim.pid))
            at = time.time()
            self.cluster.kill(victim)
            self.kills.append((at, pids))
            self.snapshot(pids, at)
