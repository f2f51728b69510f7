"""``--only fanout``: one turn of many tool calls.

one turn of 100 instant tool calls: model response to next model call, and SQL statements
per tool call, counted inside the workers (``scripts/_bench_support.py``).
"""

from __future__ import annotations

import statistics

from benchmarks.harness import TOOL, Row, progress, ts, turn_overheads


class FanoutFigure:
    """A turn of 100 instant tool calls, and one of 8 threadsafe ones run at once."""

    def fanout(self) -> None:
        n = self.sizes.fanout_calls
        calls = [{"id": f"c{i}", "name": TOOL, "arguments": {"value": str(i)}} for i in range(n)]
        model = self.script(f"fanout-{n}", [{"tool_calls": calls}, {"say": "done"}])
        for _ in range(self.sizes.trials):
            prefix = self.new_prefix("fanout")
            before = self.settled_stats()
            self.submit(model, prefix, 1)
            self.wait_done(prefix, 1, timeout=120)
            delta = self.stats_delta(before, self.settled_stats())
            rows = self.transitions(prefix)
            response = next(r for r in rows if r.from_phase == "call_model")
            nxt = [r for r in rows if r.from_phase == "call_model"][1]
            self.results.add("fanout.s", ts(nxt.at) - nxt.duration_ms / 1000 - ts(response.at))
            ticks, _, statements = self.loop_counts(delta)
            invoke_statements = delta.get("charlie.tool.invoke", [0, 0])[1]
            self.results.add("fanout.statements_per_call", statements / n)
            self.results.add("fanout.invoke_statements_per_call", invoke_statements / n)
            self.results.add("fanout.ticks", ticks)
            self.results.info["fanout.last_delta"] = delta
            took = self.results.values["fanout.s"][-1]
            progress(f"fan-out of {n}: {took:.2f}s, {statements / n:.1f} statements per call")
        self.local_fanout()

    def local_fanout(self) -> None:
        """A turn of K = 8 calls (the dispatch batch) of the threadsafe instant tool, which the
        worker that dispatched them runs at once: response to the next model call,
        and a steady such turn's commits (a run of 3 turns less one of 1, over 2)."""
        k = 8
        calls = [{"id": f"c{i}", "name": TOOL, "arguments": {"value": str(i)}} for i in range(k)]
        for _ in range(self.sizes.trials):
            commits, seconds = {}, []
            for turns in (1, 3):
                model = self.script(f"local-{k}-{turns}", [{"tool_calls": calls}] * turns + [
                    {"say": "done"}])  # fmt: skip
                prefix = self.new_prefix("local")
                before = self.settled_stats()
                self.submit(model, prefix, 1)
                self.wait_done(prefix, 1, timeout=120)
                commits[turns] = self.loop_commits(self.stats_delta(before, self.settled_stats()))
                seconds += turn_overheads(self.transitions(prefix))
            self.results.add("fanout_local.ms", statistics.median(seconds) * 1000)
            self.results.add("fanout_local.commits", (commits[3] - commits[1]) / 2)
            progress(
                f"local fan-out of {k}: {statistics.median(seconds) * 1000:.1f} ms, "
                f"{(commits[3] - commits[1]) / 2:.1f} commits per turn"
            )


ROWS: list[Row | str] = [
    "**Fan-out** (one turn of 100 instant tool calls)",
    Row("Model response → next model call (s)", "fanout.s", 2, "≤ 3 s"),
    Row("SQL statements per tool call (whole turn)", "fanout.statements_per_call", 1, "bounded"),
    Row("SQL statements per tool invocation task", "fanout.invoke_statements_per_call", 1),
    Row(
        "A turn of 8 threadsafe calls, run at once by its worker: response → next model call (ms)",
        "fanout_local.ms",
        1,
    ),
    Row("... its commits (a steady turn)", "fanout_local.commits", 1, "≤ K + 2 = 10"),
]
