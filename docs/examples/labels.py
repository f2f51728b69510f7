"""Tools a worker registers by importing this module (CHARLIE_TOOL_MODULES=labels)."""

from __future__ import annotations

import charlie
from charlie.domain import Outcome
from charlie.tools import Reconciled, ToolContext


def label_exists(order_id: str, address: str, ctx: ToolContext) -> Reconciled | None:
    """The reconcile hook: called with the tool's own arguments (and its context) when
    a call is found started without a result after a crash. It reads back what
    happened; returning None instead means "cannot tell": the call is `interrupted`."""
    try:
        ctx.read_text(f"labels/{order_id}.txt")
    except FileNotFoundError:
        missing = {"error": "no label was printed; print it again"}
        return Reconciled(Outcome.ERROR, missing)
    return Reconciled(Outcome.OK, {"label": f"labels/{order_id}.txt"})


@charlie.tool(effect="write", deadline=30, reconcile=label_exists)
def print_label(order_id: str, address: str, ctx: ToolContext) -> dict[str, str]:
    """Print a shipping label for an order."""  # what the model is told
    # opened beneath the task's workspace, at the moment of the write, or refused
    ctx.write_text(f"labels/{order_id}.txt", address)
    return {"label": f"labels/{order_id}.txt"}
