"""When an inline chain stops and publishes its next step (CHARLIE_INLINE_PHASES): each step
is claimed, committed and recorded on its own either way (I21); what the rule decides is only
how often a run gives its worker slot back, and so what a stop costs per turn."""

from __future__ import annotations

from charlie.executor.tick import INLINE_MIN_SECONDS, INLINE_SECONDS, chain_goes_on

START = 1000.0
FLOOR, DEADLINE = START + INLINE_MIN_SECONDS, START + INLINE_SECONDS


def test_inline_steps_off_publishes_every_step() -> None:
    assert not chain_goes_on(0, 30, FLOOR, DEADLINE, START)


def test_a_quick_chain_outlasts_its_step_budget_until_its_floor() -> None:
    # the budget spent in a tenth of a second: the chain goes on, a stop costs too much
    assert chain_goes_on(30, 0, FLOOR, DEADLINE, START + 0.1)
    assert chain_goes_on(30, -40, FLOOR, DEADLINE, START + INLINE_MIN_SECONDS - 0.001)
    # past the floor the spent budget stops it: another run gets the slot
    assert not chain_goes_on(30, 0, FLOOR, DEADLINE, START + INLINE_MIN_SECONDS)


def test_a_slow_chain_stops_on_its_budget_or_its_deadline() -> None:
    assert chain_goes_on(30, 1, FLOOR, DEADLINE, START + 5)
    assert not chain_goes_on(30, 0, FLOOR, DEADLINE, START + 5)
    # the deadline stops it whatever its budget
    assert not chain_goes_on(30, 25, FLOOR, DEADLINE, DEADLINE)
