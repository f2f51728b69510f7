"""The engine's side of the tools' Children port: start and read tasks (delegation, I19).

Handed to each call in its ToolContext, so the tool SDK reaches the scheduler, the store and
the publisher without importing them.
"""

from __future__ import annotations

from charlie import pricing, scheduler
from charlie.domain import JSON, Phase, TaskStatus
from charlie.runtime import Runtime
from charlie.store import reads
from charlie.store.engine import read, retried_if_disconnected
from charlie.tools.context import ChildSubmitted, TaskSnapshot, ToolError
from charlie.tools.delegation import child_limits


class DbChildren:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def get(self, task_id: str) -> TaskSnapshot | None:
        return _snapshot(self.rt, task_id)

    def submit(
        self,
        *,
        prompt: str,
        model: str,
        tools: list[str] | None,
        task_id: str,
        metadata: JSON,
        parent_id: str,
        parent_call_id: str,
    ) -> ChildSubmitted:
        parent = self.get(parent_id)
        if parent is None:
            raise ToolError(f"cannot delegate: parent task {parent_id} is gone")
        # Whichever tool asks, a child gets no tool or model its parent may not use (issue 12
        # item 1): delegate checks first, for its message; this is the engine's own check.
        tools, model = child_limits(parent, tools, model, self.rt.settings.delegate_models)
        if tools is not None:
            unknown = [t for t in tools if self.rt.tools.get(t) is None]
            if unknown:
                raise ToolError(f"cannot delegate: unknown tool(s): {', '.join(unknown)}")
        # A child gets the default budget of CHARLIE_BUDGET_* (its own usage starts at 0).
        try:
            budget = pricing.with_defaults(None, self.rt.settings.budget_defaults)
            if budget and "usd" in budget:
                pricing.check_priced(budget, model, pricing.price_table(self.rt.settings.prices))
        except (pricing.BudgetError, pricing.PriceError) as exc:
            raise ToolError(f"cannot delegate: {exc}") from None
        try:
            submitted = scheduler.submit(
                self.rt.engine,
                prompt=prompt,
                model=model,
                tools=tools,
                task_id=task_id,
                timeout=None,
                metadata=metadata,
                parent_id=parent_id,
                parent_call_id=parent_call_id,
                budget=budget,
            )
        except scheduler.ParentStopped as stopped:
            raise ToolError(str(stopped)) from None
        if submitted.created:
            self.rt.publisher.tick(submitted.execution_id, Phase.LOAD_CONTEXT, 0)
        return ChildSubmitted(submitted.task_id, submitted.created)


@retried_if_disconnected
def _snapshot(rt: Runtime, task_id: str) -> TaskSnapshot | None:
    with read(rt.engine) as conn:
        row = reads.task_with_run(conn, task_id)
    if row is None:
        return None
    return TaskSnapshot(
        id=row.id,
        status=TaskStatus(row.status),
        result=row.result,
        error=row.error,
        model=row.model,
        metadata=row.metadata or {},
        parent_id=row.parent_id,
        tools=list(row.tools) if row.tools is not None else None,
    )
