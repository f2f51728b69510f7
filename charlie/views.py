"""Charlie's own views of a run: the transcript with each tool call and its result as one row."""

from __future__ import annotations

import json
from typing import Any

from charlie import api
from charlie.terminal import printable


def short(value: Any, limit: int = 100) -> str:
    """One line of at most ``limit`` characters for a terminal: control and format characters
    shown, not obeyed (charlie.terminal; before whitespace is folded, so a CR is seen), runs of
    whitespace folded into one space."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = " ".join(printable(str(text), multiline=True).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def transcript_rows(task_id: str, *, after_seq: int = -1) -> list[tuple[int, str]]:
    """(seq, line) rows; a tool call's row shows its outcome and timing once it has a result."""
    entries = api.transcript(task_id)
    by_call = {(c.turn, c.call_id): c for c in api.calls(task_id)}
    results = {(e.turn, e.call_id) for e in entries if e.kind == "tool_result"}
    rows: list[tuple[int, str]] = []
    for entry in entries:
        if entry.seq <= after_seq or entry.kind == "tool_result":
            continue
        payload = entry.payload
        if entry.kind == "tool_call":
            key = (entry.turn, entry.call_id or "")
            if key not in results:
                break  # shown once the turn has settled, so rows never change after printing
            call = by_call.get(key)
            outcome = (call.outcome or call.state) if call else "?"
            took = f"{call.duration_ms:.0f} ms" if call and call.duration_ms is not None else "-"
            result = short(call.result, 80) if call and call.result is not None else ""
            if call and call.late_reports:
                # I12: the outcome stands; what came after it is shown beside it.
                late = call.late_result or {}
                result += f"  (late report: {late.get('outcome')}, {short(late.get('result'), 60)})"
            line = (
                f"  ↳ {short(payload.get('name'), 80)}"
                f"({short(payload.get('raw_arguments', ''), 60)})"
                f"  [{outcome}, {took}]  {result}"
            )
        elif entry.kind == "input":
            line = f"{payload.get('role')}: {short(payload.get('content'), 100)}"
        elif entry.kind == "final":
            line = "final: " + _body(payload.get("content"), indent=" " * 8 + "| ")
        elif entry.kind == "compaction":
            line = f"{compaction_text(payload)}: {short(payload.get('content'), 100)}"
        else:
            text = payload.get("content") or payload.get("summary") or ""
            line = f"{entry.kind}: {short(text, 120)}"
        rows.append((entry.seq, f"{entry.seq:>3} t{entry.turn}  {line}"))
    return rows


def compaction_text(payload: dict[str, Any]) -> str:
    """What a compaction covers and what it saved: ``compaction of items 2-41 (about 5200 ->
    1300 tokens, by openai:gpt-4.1)``; the items it covers stay in the record (I29)."""
    covers = payload.get("covers") or ["?", "?"]
    return (
        f"compaction of items {covers[0]}-{covers[-1]} (about {payload.get('tokens_before')} -> "
        f"{payload.get('tokens_after')} tokens, by {short(payload.get('model'), 60)})"
    )


def _body(value: Any, *, indent: str) -> str:
    """A model's multi-line text under a row's prefix: its newlines kept, every other control
    shown (charlie.terminal), each further line indented, so no line of it can pass for a row
    of Charlie's own."""
    text = printable(value if isinstance(value, str) else str(value), multiline=True)
    return text.replace("\n", "\n" + indent)


def usd(amount: float | None) -> str:
    """A cost for people: ``$0.0123``; ``-`` when no price is known (CHARLIE_PRICES)."""
    if amount is None:
        return "-"
    return f"${amount:.4f}" if amount < 100 else f"${amount:,.2f}"


def tokens_text(usage: dict[str, Any], sep: str = ", ") -> str:
    """``in 1200, out 80, reasoning 20`` and, when a prompt cache was used, ``cache read 900,
    cache write 300`` (parts of the input tokens)."""
    parts = [
        f"in {usage.get('input_tokens', 0)}",
        f"out {usage.get('output_tokens', 0)}",
        f"reasoning {usage.get('reasoning_tokens', 0)}",
    ]
    read, written = usage.get("cache_read_tokens") or 0, usage.get("cache_write_tokens") or 0
    if read or written:
        parts += [f"cache read {read}", f"cache write {written}"]
    return sep.join(parts)


def budget_text(info: api.TaskInfo) -> str:
    """``model_calls 2 of 2, tokens 340 of 1000``; ``none`` without a budget."""
    parts = []
    for key, used, limit in info.budget_used():
        if key == "usd":
            parts.append(f"usd {usd(used)} of {usd(float(limit))}")
        else:
            parts.append(f"{key} {used} of {limit}")
    return ", ".join(parts) or "none"
