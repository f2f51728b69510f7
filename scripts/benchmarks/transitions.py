"""``--only transitions``: what a transition and a turn cost (run together with the floor).

scripted tasks of T turns, each turn one instant tool call and an instant model, for 1 run
and for 50 concurrent runs. A transition is a row of the ``transitions`` table; the rate is
rows / (last transition - first submit); ms/transition is 1000 / rate (for one run, the
latency of a transition; for 50, its amortised cost). Per-turn overhead: from the commit of
a model response (call_model -> dispatch_tools) to the start of the next model call's tick
(the next call_model transition's time minus its duration).
"""

from __future__ import annotations

from benchmarks.harness import Row


class TransitionsFigure:
    """Charlie's runs, 1 and 50 at once, trial by trial with the floor's chains and DBOS."""

    def transitions_and_floor(self, with_charlie: bool, with_floor: bool) -> None:
        s = self.sizes
        for _ in range(s.trials):
            c1 = self.charlie_runs(1, s.turns_one, "one") if with_charlie else None
            f1 = self.floor_chains(1, s.links_one, "floor_one") if with_floor else None
            cn = self.charlie_runs(s.runs_many, s.turns_many, "many") if with_charlie else None
            fn = self.floor_chains(s.runs_many, s.links_many, "floor_many") if with_floor else None
            if c1 and f1:
                self.results.add("ratio_one", c1 / f1)
                turn_ms = self.results.values["turn.ms"][-1]
                self.results.add("turn.floor_units", turn_ms / (1000 / f1))
            if cn and fn:
                self.results.add("ratio_many", cn / fn)
            if c1 and self.dbos_python and self.backend.name == "postgres":
                self.dbos_trial()


#: the table's rows: the transitions and a turn's cost
ROWS: list[Row | str] = [
    "**Transitions** (scripted tasks: each turn one instant tool call and an instant model)",
    Row("Charlie, 1 run: transitions/s", "one.tps"),
    Row("Charlie, 1 run: ms per transition", "one.ms", 1),
    Row("Floor, 1 chain: links/s", "floor_one.tps"),
    Row("Floor, 1 chain: ms per link", "floor_one.ms", 1),
    Row("Charlie / floor, 1 run", "ratio_one", 2, "≥ 0.80"),
    Row("Charlie, 50 runs: transitions/s", "many.tps"),
    Row("Charlie, 50 runs: ms per transition (1000 / rate)", "many.ms", 1),
    Row("Floor, 50 chains: links/s", "floor_many.tps"),
    Row("Charlie / floor, 50 runs", "ratio_many", 2, "≥ 0.80"),
    Row("Celery tasks per transition, 50 runs", "many.tasks_per_transition", 2),
    Row("SQL statements per transition, 50 runs", "many.statements_per_transition", 1),
    Row("Per-turn overhead: model response → next model call (ms)", "turn.ms", 1),
    Row("Per-turn overhead, in floor transitions", "turn.floor_units", 1, "≤ 4"),
    "**Per turn** (a run's turns, its first load and last report spread over them)",
    Row("Charlie, 1 run: ms per turn (wall / turns)", "one.turn_wall_ms", 1),
    Row("Charlie, 50 runs: ms per turn (wall / all turns)", "many.turn_wall_ms", 2),
    Row("Commits per turn, 1 run (in the workers)", "one.commits_per_turn", 2, "≤ 3"),
    Row("Commits per turn, 50 runs (in the workers)", "many.commits_per_turn", 2, "≤ 3"),
    Row(
        "Commits per turn, 1 run (server: xact_commit, sweeps and polls too)",
        "one.server_commits_per_turn",
        1,
    ),
    Row("Commits per turn, 50 runs (server)", "many.server_commits_per_turn", 1),
    Row("WAL bytes per turn, 1 run (whole server)", "one.wal_bytes_per_turn"),
    Row("WAL bytes per turn, 50 runs (whole server)", "many.wal_bytes_per_turn"),
    Row("SQL statements per turn, 1 run", "one.statements_per_turn", 1),
    Row("SQL statements per turn, 50 runs", "many.statements_per_turn", 1),
]
