"""I5: one keeper thread renews every lease a process's work holds, while the work lasts."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from sqlalchemy import Connection

from charlie.leases import LeaseKeeper
from charlie.store.engine import get_engine


def keeper(tmp_path: Path) -> LeaseKeeper:
    return LeaseKeeper(get_engine(f"sqlite:///{tmp_path / 'leases.db'}"))


def test_a_held_lease_is_renewed_every_interval_until_released(tmp_path: Path) -> None:
    leases = keeper(tmp_path)
    renewals: list[float] = []

    def renew(conn: Connection) -> bool:
        assert conn.in_transaction()  # each renewal is its own short transaction
        renewals.append(time.monotonic())
        return True

    with leases.held(renew, 0.1, "long work"):
        time.sleep(0.55)
    held = len(renewals)
    time.sleep(0.3)
    assert 3 <= held <= 6, renewals
    assert len(renewals) == held  # nothing renewed after release


def test_work_shorter_than_the_interval_is_never_renewed(tmp_path: Path) -> None:
    leases = keeper(tmp_path)
    renewals: list[str] = []
    for n in range(50):
        with leases.held(lambda _c, n=n: renewals.append(str(n)) or True, 0.2, f"short {n}"):
            pass
    time.sleep(0.4)
    assert renewals == []


def test_a_lease_reported_lost_is_not_renewed_again(tmp_path: Path) -> None:
    leases = keeper(tmp_path)
    calls: list[int] = []

    def lost(conn: Connection) -> bool:
        calls.append(1)
        return False

    with leases.held(lost, 0.05, "taken over"):
        time.sleep(0.4)
    assert calls == [1]


def test_leases_of_concurrent_work_are_kept_independently(tmp_path: Path) -> None:
    leases = keeper(tmp_path)
    counts = {"a": 0, "b": 0}

    def renewer(key: str):  # type: ignore[no-untyped-def]
        def renew(_conn: Connection) -> bool:
            counts[key] += 1
            return True

        return renew

    def work(key: str, seconds: float) -> None:
        with leases.held(renewer(key), 0.05, key):
            time.sleep(seconds)

    threads = [
        threading.Thread(target=work, args=("a", 0.5)),
        threading.Thread(target=work, args=("b", 0.2)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts["a"] > counts["b"] >= 2
