"""One module per phase. Each exposes ``NEEDS`` (what the shell must load: ``"items"``,
``"calls"``) and ``run(view, deps) -> Transition``, a function from durable state to the next
durable state that imports neither Celery nor SQLAlchemy."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from charlie.domain import Phase, RunView, Transition
from charlie.executor.phases import (
    advance_turn,
    await_tools,
    call_model,
    dispatch_tools,
    load_context,
    report_failure,
    report_terminal,
)
from charlie.ports import PhaseDeps

PhaseFn = Callable[[RunView, PhaseDeps], Transition]

MODULES: dict[Phase, ModuleType] = {
    Phase.LOAD_CONTEXT: load_context,
    Phase.CALL_MODEL: call_model,
    Phase.DISPATCH_TOOLS: dispatch_tools,
    Phase.AWAIT_TOOLS: await_tools,
    Phase.ADVANCE_TURN: advance_turn,
    Phase.REPORT_TERMINAL: report_terminal,
    Phase.REPORT_FAILURE: report_failure,
}


def needs(phase: Phase) -> frozenset[str]:
    module = MODULES.get(phase)
    return frozenset(getattr(module, "NEEDS", ())) if module else frozenset()


def run_phase(view: RunView, deps: PhaseDeps) -> Transition:
    fn: PhaseFn = MODULES[view.phase].run
    return fn(view, deps)
