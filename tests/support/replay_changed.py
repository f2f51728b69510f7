"""Today's code for a replay test (tests/integration/test_replay.py): the test tools, with
``echo_number`` changed to return something more, its schema and description unchanged."""

from __future__ import annotations

import tests.support.tools
from charlie.tools.registry import REGISTRY, build_tool


def echo_number(value: float) -> dict[str, float | bool]:
    return {"value": value, "half": value / 2, "changed": True}


_before = REGISTRY.get("echo_number")
assert _before is not None
echo_number.__doc__ = tests.support.tools.echo_number.__doc__
REGISTRY.replace(build_tool(echo_number, effect="read", threadsafe=True))
