"""Fault kind: MCP tools over stdio (``--mcp-share``): an MCP read and an MCP write in a share of
the tasks, and the test server's own ledger checked: no MCP write ran twice (I10).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

from chaos_kinds.harness import MAX_MESSAGES, Plan
from tests.support.cluster import McpServers


def add_mcp_turn(plan: Plan, share: float, seed: int) -> None:
    """For a share of tasks, one more turn just before the final answer: an MCP read and an
    MCP write over stdio. It takes over what the final answer's turn was to be shown
    (the turn before it may be a person's), and has its own random stream, so the rest of a
    seed's run is what it was without it."""
    rng = random.Random(f"{seed}-mcp-{plan.n}")
    if rng.random() >= share:
        return
    n = plan.n
    calls = [
        {"id": "mr", "name": "mcp__files__lookup", "arguments": {"key": f"m-{n}"}},
        {
            "id": "mw",
            "name": "mcp__files__delete_record",
            "arguments": {"key": f"m-{n}", "hold": rng.uniform(0, 1)},
        },
    ]
    final = len(plan.turns) - MAX_MESSAGES - 1
    turn: dict[str, Any] = {"say": "the MCP tools", "tool_calls": calls}
    if "expect" in plan.turns[final]:
        turn["expect"] = plan.turns[final].pop("expect")
    plan.turns.insert(final, turn)


def mcp_violations(home: Path) -> list[str]:
    """I10 for MCP writes: the test server's ledger, outside Charlie, ran each at most once."""
    ledger = McpServers(home, 0, 0, 0).ledger
    if not ledger.exists():
        return []
    rows = [json.loads(line) for line in ledger.read_text().splitlines() if line.strip()]
    runs = Counter(r["key"] for r in rows if r["event"] == "delete.start")
    return [f"MCP write {key} ran {count}x" for key, count in runs.items() if count > 1]
