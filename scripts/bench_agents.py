#!/usr/bin/env python
"""What a Pydantic AI agent's turn costs as a Charlie task (docs/agents/pydantic-ai.md).

    python scripts/bench_agents.py --turns 10 --trials 3

In one run, against one local Chat Completions server that answers at once
(tests/support/fake_openai.py) and on SQLite + the embedded broker in a fresh CHARLIE_HOME
(one ``charlie worker -c 2``), trial by trial:

agent
    tests/support/agents.py's ``support`` agent as a Charlie task (``agent=``): each turn one
    call of its read tool ``lookup``, then its structured output.
native
    a native Charlie task doing the same turns: ``openai:gpt-4.1`` through Charlie's own client,
    each turn one call of the native read tool ``sleep_then`` (0 s), then a text answer.
plain
    the same agent's own ``agent.run`` in this process, against the same server.

Per turn: the task's time from its start to its end (``started_at`` to ``finished_at``),
divided by its turns (the final answer's counted as one); plain: ``agent.run``'s wall time the
same way. The figures are medians over the trials, min-max beside them; on a loaded machine
they are that machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _answers(agent: bool, turns: int) -> Any:
    from tests.support.fake_openai import Reply, chat_stream, chat_text, chat_tool_calls

    def answer(recorded: Any) -> Reply:
        body = recorded.body or {}
        streamed = bool(body.get("stream"))

        def calls(found: list[tuple[str, str, str]]) -> Reply:
            return chat_stream(calls=found) if streamed else chat_tool_calls(found)

        done = sum(1 for m in body.get("messages", []) if m.get("role") == "tool")
        n = done + 1
        if done < turns:
            if agent:
                return calls([(f"c{n}", "lookup", json.dumps({"account": f"a{n}"}))])
            return calls([(f"c{n}", "sleep_then", json.dumps({"seconds": 0, "value": f"v{n}"}))])
        if agent:
            return calls([("f", "final_result", json.dumps({"account": "a", "charged_cents": 0}))])
        return chat_stream("done") if streamed else chat_text("done")

    return answer


def _stats(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--patience", type=float, default=300, help="seconds a task may take")
    args = parser.parse_args()

    from tests.support.fake_openai import FakeOpenAI, ProviderLimit

    server = FakeOpenAI().start()
    home = Path(tempfile.mkdtemp(prefix="charlie-bench-agents-"))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CHARLIE_")},
        "CHARLIE_HOME": str(home),
        "CHARLIE_TOOL_MODULES": "tests.support.tools,tests.support.agents",
        "CHARLIE_TEST_LEDGER": str(home / "ledger.jsonl"),
        "CHARLIE_MODEL_BASE_URL": server.url,
        "CHARLIE_MODEL_API_KEY": "bench",
        "CHARLIE_TASK_EVENTS": "0",
        "PYTHONPATH": str(REPO),
    }
    os.environ.update(env)
    log = open(home / "worker.log", "wb")  # noqa: SIM115 (open while the worker runs)
    worker = subprocess.Popen(
        [sys.executable, "-m", "charlie", "worker", "-c", "2"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        import charlie
        from tests.support.agents import make_deps, support

        def task_turn(agent: bool) -> float:
            server.limit = ProviderLimit(answer=_answers(agent, args.turns))
            if agent:
                task_id = charlie.submit(
                    "bench",
                    agent="tests.support.agents:support",
                    deps="tests.support.agents:make_deps",
                )
            else:
                task_id = charlie.submit("bench", model="openai:gpt-4.1", tools=["sleep_then"])
            info = charlie.wait(task_id, timeout=args.patience)
            assert info.status.value == "succeeded", info.error
            assert info.started_at is not None and info.finished_at is not None
            seconds = (info.finished_at - info.started_at).total_seconds()
            return 1000 * seconds / (args.turns + 1)

        def plain_turn() -> float:
            server.limit = ProviderLimit(answer=_answers(True, args.turns))
            started = time.perf_counter()
            support.run_sync("bench", deps=make_deps())
            return 1000 * (time.perf_counter() - started) / (args.turns + 1)

        task_turn(True)  # warm: the worker processes import the agent once
        task_turn(False)
        figures: dict[str, list[float]] = {"agent": [], "native": [], "plain": []}
        for _ in range(args.trials):
            figures["agent"].append(task_turn(True))
            figures["native"].append(task_turn(False))
            figures["plain"].append(plain_turn())
        print(f"{args.turns} tool turns + the answer, {args.trials} trials; ms per turn:")
        for name, values in figures.items():
            print(f"  {name:<7} {_stats(values)}")
        ratio = [a - n for a, n in zip(figures["agent"], figures["native"], strict=True)]
        print(f"  agent - native, trial by trial: {' / '.join(f'{r:.1f}' for r in ratio)}")
    finally:
        os.killpg(worker.pid, 9)
        worker.wait()
        server.stop()


if __name__ == "__main__":
    main()
