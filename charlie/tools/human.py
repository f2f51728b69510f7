"""``ask_human``: the model asks a person, and the person's reply is the call's result.

No worker runs it: the dispatch marks the call queued with its deadline and holds it for a
reply (``charlie.reply``), so a task waiting for an answer holds no worker process and no lease
(I25). Past its deadline (CHARLIE_HUMAN_DEADLINE) it settles ``deadline_exceeded`` as any call
does, and a reply after that is recorded as a late report (I12, I13).
"""

from __future__ import annotations

from charlie.domain import Effect
from charlie.tools.context import ToolError
from charlie.tools.registry import REGISTRY, build_tool


def ask_human(question: str) -> str:
    """Ask a person a question and wait for their answer (which may take hours). Use it when
    you need a decision or information only a person has; the answer is the result."""
    # Never dispatched to a worker (answered_by_person): a call reaching here came through a
    # path that bypassed the hold, and must not pass for an answer.
    raise ToolError("ask_human is answered by a person (charlie reply), not run by a worker")


ASK_HUMAN = REGISTRY.add(build_tool(ask_human, effect=Effect.WAIT, answered_by_person=True))
