"""report_failure: record a run that could not continue, with its structured error (I17)."""

from __future__ import annotations

from charlie.domain import RunView, TaskStatus, Transition
from charlie.executor.phases.report_terminal import report
from charlie.ports import PhaseDeps

NEEDS: frozenset[str] = frozenset()


def run(view: RunView, deps: PhaseDeps) -> Transition:
    error = view.state.get("error") or {"type": "unknown", "message": "no error state recorded"}
    return report(view, deps, TaskStatus.FAILED, error=error)
