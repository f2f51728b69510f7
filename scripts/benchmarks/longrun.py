"""``--only longrun``: one run of 200 turns, with a context window and without.

one run of 200 turns, each a tool call with a 4 KiB result (800 KiB in all), its scripted
model given a context window of 16,000 tokens (CHARLIE_MODEL_<NAME>_CONTEXT_TOKENS): the
largest model input (characters of content / 4, as the model's ledger saw it) against the
window, the compactions made, and the turn time (call_model's commit to the next one's:
the input's assembly included) and call_model's own tick, medians over turns 5-55 and
150-200; then the same run with no window
(every input the whole transcript), for comparison.
"""

from __future__ import annotations

import itertools
import statistics

from benchmarks.harness import LONGRUN_RESULT_BYTES, Row, progress, read_jsonl, ts


class LongrunFigure:
    """A 200-turn run, windowed and then not."""

    def longrun(self) -> None:
        for label in ("windowed", "whole"):
            for _ in range(self.sizes.trials):
                self.longrun_trial(label)

    def longrun_trial(self, label: str) -> None:
        from charlie import api

        turns = self.sizes.longrun_turns
        call = {"name": "bench_page", "arguments": {"size": LONGRUN_RESULT_BYTES}}
        steps = [{"tool_calls": [{**call, "id": f"p{n}"}]} for n in range(turns)]
        ledger = self.script_dir / f"longrun-{label}.jsonl"
        ledger.unlink(missing_ok=True)
        model = self.script(f"longrun-{label}", [*steps, {"say": "done"}], ledger)
        prefix = self.new_prefix(f"longrun-{label}")
        api.submit("bench", model=model, tools=["bench_page"], task_id=f"{prefix}00000")
        self.wait_done(prefix, 1, timeout=900)
        rows = self.transitions(prefix)
        commits = [r for r in rows if r.from_phase == "call_model" and r.to_phase != "call_model"]
        gaps = [ts(b.at) - ts(a.at) for a, b in itertools.pairwise(commits)]
        # 50 turns each (one turn's time is a few ms, noisy on a shared machine)
        early, late = gaps[5:55], gaps[-51:-1]
        key = f"longrun.{label}"
        self.results.add(f"{key}.turn10_ms", statistics.median(early) * 1000)
        self.results.add(f"{key}.turn200_ms", statistics.median(late) * 1000)
        self.results.add(f"{key}.growth", statistics.median(late) / statistics.median(early))
        # call_model's own tick: the input's assembly and the (instant) model call
        ticks = [r.duration_ms for r in commits]
        tick_early, tick_late = statistics.median(ticks[5:55]), statistics.median(ticks[-51:-1])
        self.results.add(f"{key}.tick10_ms", tick_early)
        self.results.add(f"{key}.tick200_ms", tick_late)
        sent = [line.get("input_chars", 0) / 4 for line in read_jsonl(ledger)]
        self.results.add(f"{key}.max_input_tokens", max(sent) if sent else 0)
        items = api.transcript(f"{prefix}00000")
        compactions = sum(1 for i in items if i.kind == "compaction")
        self.results.add(f"{key}.compactions", compactions)
        progress(
            f"long run ({label}): turns 5-55 {statistics.median(early) * 1000:.1f} ms, turns "
            f"150-200 {statistics.median(late) * 1000:.1f} ms (call_model tick {tick_early:.1f} "
            f"-> {tick_late:.1f} ms), largest input {max(sent or [0]):.0f} tokens, "
            f"{compactions} compactions"
        )


ROWS: list[Row | str] = [
    "**Long run** (200 turns of 4 KiB results, 800 KiB in all; a 16,000-token window, then none)",
    Row("Windowed: turn time, turns 5-55 (ms, median)", "longrun.windowed.turn10_ms", 1),
    Row("Windowed: turn time, turns 150-200 (ms, median)", "longrun.windowed.turn200_ms", 1),
    Row("Windowed: late / early turn time", "longrun.windowed.growth", 2, "≤ 1.20"),
    Row("Windowed: call_model tick, turns 5-55 (ms)", "longrun.windowed.tick10_ms", 1),
    Row("Windowed: call_model tick, turns 150-200 (ms)", "longrun.windowed.tick200_ms", 1),
    Row("Windowed: largest model input (tokens, chars/4)", "longrun.windowed.max_input_tokens"),
    Row("Windowed: compactions", "longrun.windowed.compactions"),
    Row("No window: turn time, turns 5-55 (ms, median)", "longrun.whole.turn10_ms", 1),
    Row("No window: turn time, turns 150-200 (ms, median)", "longrun.whole.turn200_ms", 1),
    Row("No window: late / early turn time", "longrun.whole.growth", 2),
    Row("No window: call_model tick, turns 5-55 (ms)", "longrun.whole.tick10_ms", 1),
    Row("No window: call_model tick, turns 150-200 (ms)", "longrun.whole.tick200_ms", 1),
    Row("No window: largest model input (tokens, chars/4)", "longrun.whole.max_input_tokens"),
]
