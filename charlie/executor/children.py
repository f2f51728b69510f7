"""The engine's side of the tools' Children port: start and read tasks (delegation, I19).

Handed to each call in its ToolContext, so the tool SDK reaches the scheduler, the store and
the publisher without importing them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from charlie import pricing, scheduler
from charlie.domain import JSON, Item, Phase, TaskSpend, TaskStatus
from charlie.executor import boundary
from charlie.runtime import Runtime
from charlie.store import reads, runs, spend
from charlie.store.engine import read, retried_if_disconnected
from charlie.store.types import Connection
from charlie.tools.context import ChildSubmitted, TaskSnapshot, ToolError
from charlie.tools.delegation import child_limits


class DbRecord:
    """The run's durable transcript, for the ``recall`` tool (I29: it keeps what the model
    input elided or cut)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def result_of(self, execution_id: str, call_id: str) -> JSON | None:
        with read(self.rt.engine) as conn:
            return runs.recorded_result(conn, execution_id, call_id)

    def items(self, execution_id: str) -> list[Item]:
        """The run's whole durable transcript (a framework agent's tool is shown the run's
        messages so far, as its framework shows them; charlie/agents/)."""
        with read(self.rt.engine) as conn:
            return runs.load_items(conn, execution_id)


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
        # Whichever tool asks, a child gets no tool or model its parent may not use: delegate
        # checks first, for its message; this is the engine's own check.
        tools, model = child_limits(parent, tools, model, self.rt.settings.delegate_models)
        child_sandbox(parent, metadata)
        if tools is not None:
            unknown = [t for t in tools if self.rt.tools.get(t) is None]
            if unknown:
                raise ToolError(f"cannot delegate: unknown tool(s): {', '.join(unknown)}")
        settings = self.rt.settings

        def budget(conn: Connection) -> JSON | None:
            tree = spend.delegation_spend(conn, parent_id)
            prices: pricing.PriceTable = {}
            if settings.budget_usd is not None or any("usd" in (t.budget or {}) for t in tree):
                try:
                    prices = pricing.price_table(settings.prices)
                except pricing.PriceError as exc:
                    raise scheduler.DelegationRefused(f"cannot delegate: {exc}") from None
            return child_budget(tree, parent_id, model, settings.budget_defaults, prices)

        rules = scheduler.ChildRules(
            max_depth=settings.delegate_max_depth,
            max_children=settings.delegate_max_children,
            budget=budget,
        )
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
                rules=rules,
            )
        except scheduler.ParentStopped as stopped:
            raise ToolError(str(stopped)) from None
        except scheduler.DelegationRefused as refused:
            raise ToolError(str(refused), **refused.details) from None
        if submitted.created:
            # The child's own priority (the default: a delegate sets none), not the delegating
            # invocation's, which its message would otherwise pass on (runtime.Publisher).
            self.rt.publisher.tick(submitted.execution_id, Phase.LOAD_CONTEXT, 0, priority=0)
        return ChildSubmitted(submitted.task_id, submitted.created)


def child_sandbox(parent: TaskSnapshot, metadata: JSON) -> None:
    """I31, the sandbox part: a child's policy is never wider than its parent's, whichever
    tool asks. Network access in the sandbox (``metadata["sandbox"]["network"]``) only when
    its parent has it; a workspace only its parent's own (a parent with none gives its
    child none). A widening is a ToolError the model sees (I15); nothing is
    created."""
    policy = metadata.get("sandbox") if isinstance(metadata, dict) else None
    if isinstance(policy, dict) and policy.get("network") is True:
        own = parent.metadata.get("sandbox")
        if not (isinstance(own, dict) and own.get("network") is True):
            raise ToolError(
                "cannot delegate: network access in the sandbox is not available to this "
                "task, so not to its child",
                refused_sandbox={"network": True},
            )
    workspace = metadata.get("workspace") if isinstance(metadata, dict) else None
    if workspace is None:
        return
    own_workspace = parent.metadata.get("workspace")
    same = False
    if isinstance(own_workspace, str) and isinstance(workspace, str):
        mine, theirs = Path(os.path.realpath(own_workspace)), Path(os.path.realpath(workspace))
        same = theirs == mine
    if not same:
        # Not even a directory inside it: the parent's own commands can exchange any entry of
        # its workspace with a symlink (to /etc, say) between this check and the child's
        # first open of its root, which is opened by its path (I33); the workspace itself is
        # no entry of the workspace, so no command in it can move it.
        raise ToolError(
            f"cannot delegate: workspace {str(workspace)!r} is not this task's "
            f"({own_workspace!r}); a child works in its parent's workspace, not in a "
            "directory of it, which the parent's commands could replace",
            refused_workspace=str(workspace),
        )


def child_budget(
    tree: Sequence[TaskSpend],
    parent_id: str,
    model: str,
    defaults: Mapping[str, Any],
    prices: pricing.PriceTable,
) -> JSON | None:
    """A child's budget: what is left of its parent's budget, and of every budget above it,
    when it is delegated, each limit no more than its CHARLIE_BUDGET_* default. Its spend then
    counts against those budgets too (boundary.over_budget). Refused (DelegationRefused) when
    one of them is spent, or cannot be checked."""
    try:
        limits: dict[str, Any] = pricing.with_defaults(None, defaults) or {}
    except pricing.BudgetError as exc:
        raise scheduler.DelegationRefused(f"cannot delegate: {exc}") from None
    for scope, used, _ in boundary.budget_scopes(parent_id, tree, prices):
        whose = "this task's" if scope.task_id == parent_id else f"task {scope.task_id}'s"
        assert scope.budget is not None
        for key, left in pricing.left_of(scope.budget, used).items():
            if left is None:
                raise scheduler.DelegationRefused(
                    f"cannot delegate: {whose} usd budget cannot be checked (a model of its "
                    f"tree has no price in {pricing.PRICES_SETTING})",
                    budget=key,
                    budget_of=scope.task_id,
                )
            if left <= 0:
                raise scheduler.DelegationRefused(
                    f"cannot delegate: {whose} {key} budget is spent ({used[key]} used of "
                    f"{scope.budget[key]}, its delegated tasks' spend included); a child's "
                    "budget is what is left of its parent's",
                    budget=key,
                    budget_of=scope.task_id,
                    limit=scope.budget[key],
                    used=used[key],
                )
            limits[key] = min(limits.get(key, left), left)
    try:
        budget = pricing.validate_budget(limits)
        if budget and "usd" in budget:
            pricing.check_priced(budget, model, prices)
    except pricing.BudgetError as exc:
        raise scheduler.DelegationRefused(f"cannot delegate: {exc}") from None
    return budget


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
