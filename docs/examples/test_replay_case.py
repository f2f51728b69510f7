"""Every case exported into cases/ (`charlie export TASK -o cases/NAME.json`),
replayed with today's code: the model's answers and people's verdicts from the
record, reads run again, no write run (I35). A directory of incidents becomes a
regression suite."""

from pathlib import Path

# the tools the cases call: importing the module registers them
import labels  # noqa: F401
import pytest

from charlie.testing import replay

CASES = Path(__file__).parent / "cases"


@pytest.mark.parametrize("case", sorted(CASES.glob("*.json")), ids=lambda p: p.stem)
def test_the_case_replays_as_recorded(case: Path) -> None:
    # the reads run again in a scratch copy of this workspace (never in it)
    report = replay(case, workspace=CASES / "workspace")
    assert not report.diverged, report.render()
