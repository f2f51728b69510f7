"""DBOS on the PostgreSQL round, between Charlie's runs (``--dbos-python``): each turn a model
step and a tool step as a DBOS workflow (``scripts/_bench_dbos.py``), same database.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import tempfile
import threading
import time

from benchmarks.harness import PG_URL, SCRIPTS, Row, progress

#: seconds the DBOS process may take to start and warm up, before its pairs' own allowance
PAIRS_TIMEOUT = 120.0


class DbosFigure:
    """A DBOS trial, run by the transitions figure when an interpreter with dbos is there."""

    def dbos_trial(self) -> None:
        """DBOS on the same PostgreSQL, between Charlie's runs (scripts/_bench_dbos.py)."""
        s = self.sizes
        url = f"{PG_URL}_dbos"
        argv = [str(self.dbos_python), str(SCRIPTS / "_bench_dbos.py"), "--database-url", url]
        argv += ["--turns", str(s.turns_one), "--runs", str(s.runs_many)]
        argv += ["--runs-turns", str(s.turns_many)]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True)
            doc = json.loads(done.stdout.strip().splitlines()[-1])
        except (subprocess.SubprocessError, ValueError, IndexError) as exc:
            self.results.notes.append(f"DBOS run failed: {type(exc).__name__}: {exc}")
            return
        self.results.info["dbos"] = doc["version"]
        turn_ms = doc["turn_ms"][0]
        self.results.add("dbos.turn_ms", turn_ms)
        self.results.add("dbos.one_sps", doc["one_steps_s"][0])
        self.results.add("dbos.many_sps", doc["many_steps_s"][0])
        charlie_turn = self.results.values["turn.ms"][-1]
        self.results.add("turn_vs_dbos", charlie_turn / turn_ms)
        self.results.add(
            "whole_turn_vs_dbos", self.results.values["one.turn_wall_ms"][-1] / turn_ms
        )
        # The same figures for DBOS, per turn, 1 workflow and 50 at once.
        for which in ("one", "many"):
            for figure in ("turn_ms", "commits_per_turn", "wal_bytes_per_turn"):
                if doc.get(f"{which}_{figure}"):
                    self.results.add(f"dbos.{which}_{figure}", doc[f"{which}_{figure}"][0])
        ratios = (
            ("many_turn_vs_dbos", "many.turn_wall_ms", "dbos.many_turn_ms"),
            ("one_commits_vs_dbos", "one.commits_per_turn", "dbos.one_commits_per_turn"),
            ("many_commits_vs_dbos", "many.commits_per_turn", "dbos.many_commits_per_turn"),
            ("one_wal_vs_dbos", "one.wal_bytes_per_turn", "dbos.one_wal_bytes_per_turn"),
            ("many_wal_vs_dbos", "many.wal_bytes_per_turn", "dbos.many_wal_bytes_per_turn"),
        )
        for name, ours, theirs in ratios:
            a, b = self.results.values.get(ours), self.results.values.get(theirs)
            if a and b and b[-1]:
                self.results.add(name, a[-1] / b[-1])
        progress(f"DBOS {doc['version']}: {turn_ms:.1f} ms per turn (a model and a tool step)")
        self.dbos_pairs()

    def dbos_pairs(self) -> None:
        """Charlie's single run and DBOS's single workflow of the same turns, alternated
        ``dbos_pairs`` times (each pair's order swapped from the last's), one DBOS process
        serving them. The trial's figure is the median of the pairs' ratios: two runs taken
        a second apart see the same machine, where the trial's other figures are a minute
        apart (on this project's CI machines the speed of the same loop drifts by up to half
        from one second to the next)."""
        s = self.sizes
        argv = [str(self.dbos_python), str(SCRIPTS / "_bench_dbos.py"), "--figure", "paired"]
        argv += ["--database-url", f"{PG_URL}_dbos"]
        ours: list[float] = []
        theirs: list[float] = []
        with tempfile.TemporaryFile(mode="w+") as errors:
            proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True
            )
            # a DBOS process that hangs is killed, and its read then ends (at EOF)
            watchdog = threading.Timer(PAIRS_TIMEOUT + 60.0 * s.dbos_pairs, proc.kill)
            watchdog.start()
            try:
                self._pairs(proc, ours, theirs)
            except (OSError, ValueError, EOFError, RuntimeError, TimeoutError) as exc:
                errors.seek(0)
                tail = " ".join(errors.read().split()[-40:])
                self.results.notes.append(
                    f"DBOS pairs failed after {len(ours)} of {s.dbos_pairs}: "
                    f"{type(exc).__name__}: {exc}" + (f" (DBOS said: {tail})" if tail else "")
                )
                return
            finally:
                watchdog.cancel()
                with contextlib.suppress(OSError):
                    assert proc.stdin is not None
                    proc.stdin.close()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
        self.results.add("paired.charlie_ms", statistics.median(ours))
        self.results.add("paired.dbos_ms", statistics.median(theirs))
        self.results.add("paired.ratio", statistics.median(ratios))
        progress(
            f"{len(ratios)} pairs: Charlie {statistics.median(ours):.2f} ms, DBOS "
            f"{statistics.median(theirs):.2f} ms per turn; ratio "
            f"{' '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f})"
        )

    def _pairs(self, proc: subprocess.Popen[str], ours: list[float], theirs: list[float]) -> None:
        """Take the pairs into ``ours`` and ``theirs`` (ms per turn), with ``proc`` serving
        DBOS's side."""
        s = self.sizes
        assert proc.stdin is not None and proc.stdout is not None
        stdout = proc.stdout

        def answer(key: str) -> float:
            """The value of ``key`` in the next JSON line DBOS prints (other lines skipped)."""
            for line in stdout:
                with contextlib.suppress(ValueError):
                    doc = json.loads(line)
                    if isinstance(doc, dict) and key in doc:
                        return float(doc[key]) if key != "ready" else 0.0
            raise EOFError(f"DBOS ended (exit {proc.poll()}) before it printed {key!r}")

        answer("ready")
        for n in range(s.dbos_pairs):
            pair: dict[str, float] = {}
            for who in ("charlie", "dbos") if n % 2 == 0 else ("dbos", "charlie"):
                time.sleep(0.2)  # the last run's after-work (events, a sweep) settles
                if who == "charlie":
                    pair[who] = self.charlie_turn_wall(s.turns_one)
                else:
                    proc.stdin.write(f"{s.turns_one}\n")
                    proc.stdin.flush()
                    pair[who] = answer("turn_ms")
            ours.append(pair["charlie"])
            theirs.append(pair["dbos"])


ROWS: list[Row | str] = [
    "**DBOS** (optional: each turn a model step and a tool step as a DBOS workflow, same database)",
    Row("DBOS, 1 workflow: ms per turn", "dbos.turn_ms", 1),
    Row("Charlie per-turn overhead / DBOS per turn", "turn_vs_dbos", 2, "< 1 (stretch)"),
    Row("Charlie whole turn (wall / turns) / DBOS per turn", "whole_turn_vs_dbos", 2, "≤ 1.5"),
    Row("... trial by trial", "whole_turn_vs_dbos", 2, "", "all"),
    Row("... per-turn overhead / DBOS per turn, trial by trial", "turn_vs_dbos", 2, "", "all"),
    "*Taken in pairs*: a Charlie run and a DBOS workflow of the same turns, alternated; each "
    "trial's figure the median of its pairs",
    Row("Charlie, 1 run: ms per turn (wall / turns), paired", "paired.charlie_ms", 2),
    Row("DBOS, 1 workflow: ms per turn, paired", "paired.dbos_ms", 2),
    Row("**Charlie whole turn / DBOS turn, paired**", "paired.ratio", 2, "≤ 0.5"),
    Row("... trial by trial", "paired.ratio", 2, "", "all"),
    Row("DBOS, 50 workflows: ms per turn (wall / all turns)", "dbos.many_turn_ms", 2),
    Row("Charlie 50 runs / DBOS 50 workflows, per turn", "many_turn_vs_dbos", 2),
    Row("... trial by trial", "many_turn_vs_dbos", 2, "", "all"),
    Row("DBOS commits per turn, 1 workflow (in its process)", "dbos.one_commits_per_turn", 2),
    Row("DBOS commits per turn, 50 workflows", "dbos.many_commits_per_turn", 2),
    Row("Charlie / DBOS commits per turn, 1 / 50", "one_commits_vs_dbos", 2),
    Row("... 50 runs / 50 workflows", "many_commits_vs_dbos", 2),
    Row("DBOS WAL bytes per turn, 1 workflow", "dbos.one_wal_bytes_per_turn"),
    Row("DBOS WAL bytes per turn, 50 workflows", "dbos.many_wal_bytes_per_turn"),
    Row("Charlie / DBOS WAL bytes per turn, 1 / 50", "one_wal_vs_dbos", 2),
    Row("... 50 runs / 50 workflows", "many_wal_vs_dbos", 2),
    Row("DBOS, 1 workflow: steps/s", "dbos.one_sps"),
    Row("DBOS, 50 workflows: steps/s", "dbos.many_sps"),
]
