"""Every phase is in every registry that must know it (CONTRIBUTING.md, "Adding a phase").

A phase is named in one enum but classified in several sets across the executor, the worker
shell, the people-in-the-loop actions and the console. A new ``Phase`` member that one of them
misses runs wrong without failing: a slow phase merged into a transaction that a model call
then holds open (I5), a tool phase a resume does not re-enter at its results (I7), a phase the
worker has no Celery task for (its ticks are never consumed). This test holds the one table of
what each phase is, and fails, naming the registry and its file, when a member of ``Phase`` is
missing from the table or a registry disagrees with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from charlie import people
from charlie.domain import ENDING_PHASES, Phase
from charlie.executor import boundary, steps, tick
from charlie.executor.phases import MODULES
from charlie.store import scans

pytestmark = pytest.mark.backend_free

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Kind:
    #: it calls out (a model, the scheduler): claims, commits the claim, works with no
    #: transaction open under a heartbeat, commits again (tick.SLOW_PHASES); otherwise it runs
    #: inside its claim's transaction and may be merged with the steps around it
    #: (steps.MERGEABLE)
    slow: bool
    #: a merged transaction ends with its claim, for this worker to work from (tick.CARRIED)
    carried: bool = False
    #: a step of a tool turn (boundary.TOOL_PHASES, people._TOOL_PHASES)
    tool: bool = False
    #: it ends the run: a stop does not divert it (domain.ENDING_PHASES, scans.ENDING)
    ending: bool = False
    #: a stop here takes the waiting messages in (boundary.MAIL_AT_STOP)
    mail_at_stop: bool = False


#: What each phase is. A new Phase member needs a row here, and then its place in every
#: registry the assertions below name.
KINDS: dict[Phase, Kind | None] = {
    Phase.LOAD_CONTEXT: Kind(slow=False),
    Phase.CALL_MODEL: Kind(slow=True, carried=True, mail_at_stop=True),
    Phase.DISPATCH_TOOLS: Kind(slow=False, tool=True, mail_at_stop=True),
    Phase.AWAIT_TOOLS: Kind(slow=False, tool=True, mail_at_stop=True),
    Phase.ADVANCE_TURN: Kind(slow=False, tool=True, mail_at_stop=True),
    Phase.REPORT_TERMINAL: Kind(slow=True, carried=True, ending=True),
    Phase.REPORT_FAILURE: Kind(slow=True, ending=True),
    # the end: no tick runs in it (no module, no Celery task), but it is an ending
    Phase.DONE: None,
}

LIVE = [phase for phase in Phase if phase is not Phase.DONE]


def _kind(phase: Phase) -> Kind:
    kind = KINDS[phase]
    assert kind is not None
    return kind


def test_every_phase_has_a_row() -> None:
    missing = [phase for phase in Phase if phase not in KINDS]
    assert not missing, (
        f"{missing}: new phases; add a row to KINDS in this test and the phase to every "
        "registry CONTRIBUTING.md lists under 'Adding a phase'"
    )


@pytest.mark.parametrize("phase", LIVE, ids=str)
def test_a_live_phase_has_its_module(phase: Phase) -> None:
    module = MODULES.get(phase)
    assert module is not None, f"charlie/executor/phases/__init__.py: MODULES lacks {phase}"
    assert callable(getattr(module, "run", None)), f"{module.__name__} has no run(view, deps)"
    assert isinstance(module.NEEDS, frozenset), f"{module.__name__} has no NEEDS frozenset"
    assert module.NEEDS.issubset({"items", "calls", "messages"}), module.NEEDS


@pytest.mark.parametrize("phase", LIVE, ids=str)
def test_a_live_phase_is_slow_or_mergeable_not_both(phase: Phase) -> None:
    kind = _kind(phase)
    assert (phase in tick.SLOW_PHASES) is kind.slow, (
        f"charlie/executor/tick.py: SLOW_PHASES and {phase} (slow={kind.slow})"
    )
    assert (phase in steps.MERGEABLE) is not kind.slow, (
        f"charlie/executor/steps.py: MERGEABLE and {phase} (slow={kind.slow})"
    )
    assert (phase in tick.CARRIED) is kind.carried, f"charlie/executor/tick.py: CARRIED, {phase}"


@pytest.mark.parametrize("phase", LIVE, ids=str)
def test_a_live_phase_is_where_the_boundaries_and_people_expect(phase: Phase) -> None:
    kind = _kind(phase)
    assert (phase in boundary.TOOL_PHASES) is kind.tool, (
        f"charlie/executor/boundary.py: TOOL_PHASES, {phase}"
    )
    assert (phase.value in people._TOOL_PHASES) is kind.tool, (
        f"charlie/people.py: _TOOL_PHASES (where a resume re-enters a tool turn), {phase}"
    )
    assert (phase in boundary.MAIL_AT_STOP) is kind.mail_at_stop, (
        f"charlie/executor/boundary.py: MAIL_AT_STOP, {phase}"
    )
    assert (phase in ENDING_PHASES) is kind.ending, f"charlie/domain.py: ENDING_PHASES, {phase}"
    assert (phase.value in scans.ENDING) is kind.ending, f"charlie/store/scans.py: ENDING, {phase}"


@pytest.mark.parametrize("phase", LIVE, ids=str)
def test_a_live_phase_has_a_celery_task_and_a_colour(phase: Phase) -> None:
    from charlie import worker

    task = worker.PHASE_TASKS.get(phase)
    assert task is not None and task.name == f"charlie.phase.{phase.value}", (
        f"charlie/worker.py: PHASE_TASKS has no charlie.phase.{phase.value}"
    )
    css = (ROOT / "charlie" / "console" / "static" / "console.css").read_text()
    assert re.search(rf"rect\.phase-{phase.value}\b", css), (
        f"charlie/console/static/console.css: no rect.phase-{phase.value} (the timeline's bar)"
    )


def test_done_ends_and_runs_no_tick() -> None:
    from charlie import worker

    assert Phase.DONE in ENDING_PHASES
    assert Phase.DONE not in MODULES
    assert Phase.DONE not in worker.PHASE_TASKS
    assert Phase.DONE.value not in scans.LIVE_PHASES


def test_the_registries_hold_no_phase_the_table_lacks() -> None:
    """A registry set is no larger than the table says (a removed phase, a typo)."""
    for name, registry in [
        ("tick.SLOW_PHASES", tick.SLOW_PHASES),
        ("tick.CARRIED", tick.CARRIED),
        ("steps.MERGEABLE", steps.MERGEABLE),
        ("boundary.TOOL_PHASES", boundary.TOOL_PHASES),
        ("boundary.MAIL_AT_STOP", boundary.MAIL_AT_STOP),
    ]:
        assert set(registry) <= set(LIVE), f"{name} holds {set(registry) - set(LIVE)}"
