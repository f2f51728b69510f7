"""Prices and budgets as plain functions: the price table, what tokens cost, the
limits a submit stores, and the boundary that fails a run rather than call its model past them."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from charlie import pricing
from charlie.config import load_settings
from charlie.domain import Phase, RunView, TaskSpend, TaskStatus, TaskView
from charlie.executor import boundary
from charlie.executor.children import child_budget
from charlie.pricing import BudgetError, Price, PriceError
from charlie.scheduler import DelegationRefused

NOW = datetime(2026, 1, 1, tzinfo=UTC)

TABLE = pricing.parse_prices(
    json.dumps(
        {
            "openai:gpt-4o": {"input": 2.0, "output": 10.0},
            "openai:gpt-4o-": {"input": 1.0, "output": 4.0},
            "openai:gpt-4o-mini": {"input": 0.5, "output": 2.0},
            "openai:o-": {"input": 1.0, "output": 4.0, "reasoning": 8.0},
        }
    )
)


# -- the price table ----------------------------------------------------------------------


def test_exact_first_then_the_longest_prefix_ending_at_a_separator() -> None:
    assert pricing.price_for("openai:gpt-4o", TABLE) == Price(2.0, 10.0)
    assert pricing.price_for("openai:gpt-4o-mini", TABLE) == Price(0.5, 2.0)
    assert pricing.price_for("openai:gpt-4o-2024-08-06", TABLE) == Price(1.0, 4.0)
    # "openai:gpt-4o" does not end at a separator: it prices no other spec
    assert pricing.price_for("openai:gpt-4o2", TABLE) is None
    assert pricing.price_for("openai:gpt-4.1", TABLE) is None
    assert pricing.price_for("openai-responses:gpt-4o", TABLE) is None


def test_scripted_models_cost_nothing_and_no_real_price_is_built_in() -> None:
    table = pricing.parse_prices(None)
    assert set(table) == {"scripted:"}
    assert pricing.cost_usd("scripted:/tmp/s.json", 10**6, 10**6, 0, table) == 0.0
    assert pricing.cost_usd("openai:gpt-4.1", 1, 1, 0, table) is None


def test_cost_prices_reasoning_as_part_of_the_output() -> None:
    # 1M in at 1, 1M out at 4
    assert pricing.cost_usd("openai:gpt-4o-x", 10**6, 10**6, 0, TABLE) == pytest.approx(5.0)
    # of 1M output tokens, 250k reasoning at 8: 0.75M * 4 + 0.25M * 8 = 5, + 1 input
    assert pricing.cost_usd("openai:o-3", 10**6, 10**6, 250_000, TABLE) == pytest.approx(6.0)
    # without a reasoning price, reasoning costs what output does
    assert pricing.cost_usd("openai:gpt-4o-x", 0, 10**6, 10**6, TABLE) == pytest.approx(4.0)
    assert pricing.total_tokens(100, 50, 20) == 150


def test_the_table_is_read_from_a_file_and_may_override_the_builtin(tmp_path: Path) -> None:
    path = tmp_path / "prices.json"
    path.write_text(
        json.dumps({"scripted:": {"input": 1, "output": 1}, "m:x": {"input": 0, "output": 3}})
    )
    table = pricing.parse_prices(str(path))
    assert table["scripted:"] == Price(1.0, 1.0)
    assert pricing.cost_usd("m:x", 5, 10**6, 0, table) == pytest.approx(3.0)


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "is neither a JSON object nor a readable file"),
        ('{"m:x": 3}', "must be {"),
        ('{"m:x": {"input": 1}}', "lacks output"),
        ('{"m:x": {"input": 1, "output": "2"}}', "must be a number"),
        ('{"m:x": {"input": -1, "output": 2}}', "must not be negative"),
        ('{"m:x": {"input": 1, "output": 2, "cached": 1}}', "unknown key(s) cached"),
        ("/nonexistent/prices.json", "neither a JSON object nor a readable file"),
    ],
)
def test_a_bad_table_is_a_clear_error_naming_the_setting(raw: str, says: str) -> None:
    with pytest.raises(PriceError, match="CHARLIE_PRICES") as caught:
        pricing.parse_prices(raw)
    assert says in str(caught.value)


# -- budgets ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("budget", "says"),
    [
        ({"tokens": 0}, "must be positive"),
        ({"usd": -1}, "must be positive"),
        ({"model_calls": 1.5}, "whole number"),
        ({"tokens": "100"}, "must be a number"),
        ({"tokens": True}, "must be a number"),
        ({"seconds": 3}, "unknown budget key(s) seconds"),
        ([1], "must be an object"),
        ({"usd": float("nan")}, "must be positive"),
    ],
)
def test_a_bad_budget_is_refused(budget: Any, says: str) -> None:
    with pytest.raises(BudgetError) as caught:
        pricing.validate_budget(budget)
    assert says in str(caught.value)


def test_defaults_fill_the_keys_not_given_and_none_drops_one() -> None:
    defaults = {"tokens": 1000, "usd": None, "model_calls": 5}
    assert pricing.with_defaults(None, defaults) == {"tokens": 1000, "model_calls": 5}
    assert pricing.with_defaults({"tokens": 10}, defaults) == {"tokens": 10, "model_calls": 5}
    assert pricing.with_defaults({"model_calls": None}, defaults) == {"tokens": 1000}
    assert pricing.with_defaults({}, {}) is None
    assert pricing.with_defaults({"usd": 2}, {}) == {"usd": 2.0}


def test_a_usd_budget_needs_a_price() -> None:
    pricing.check_priced({"usd": 1.0}, "openai:gpt-4o", TABLE)
    pricing.check_priced({"tokens": 5}, "openai:unpriced", TABLE)
    with pytest.raises(BudgetError, match="add it to CHARLIE_PRICES"):
        pricing.check_priced({"usd": 1.0}, "openai:unpriced", TABLE)


def test_budget_settings_parse_and_fail_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHARLIE_BUDGET_TOKENS", "5000")
    monkeypatch.setenv("CHARLIE_BUDGET_USD", "0.25")
    monkeypatch.setenv("CHARLIE_BUDGET_MODEL_CALLS", "")
    s = load_settings()
    assert s.budget_defaults == {"tokens": 5000, "usd": 0.25, "model_calls": None}
    monkeypatch.setenv("CHARLIE_BUDGET_MODEL_CALLS", "0")
    with pytest.raises(ValueError, match="CHARLIE_BUDGET_MODEL_CALLS='0' must be positive"):
        load_settings()
    monkeypatch.setenv("CHARLIE_BUDGET_MODEL_CALLS", "many")
    with pytest.raises(ValueError, match="CHARLIE_BUDGET_MODEL_CALLS='many' is not a whole"):
        load_settings()


# -- the boundary -------------------------------------------------------------------------


def run_view(budget: dict[str, Any] | None, usage: dict[str, Any] | None, **kw: Any) -> RunView:
    task = TaskView(
        "t",
        "prompt",
        kw.get("model", "openai:gpt-4o"),
        None,
        {},
        TaskStatus.RUNNING,
        None,
        None,
        budget=budget,
        usage=usage,
    )
    return RunView(
        execution_id="x-t",
        phase=kw.get("phase", Phase.CALL_MODEL),
        version=7,
        turn=2,
        state={"k": 1},
        attempts=1,
        task=task,
        now=NOW,
    )


USAGE = {"input_tokens": 600, "output_tokens": 400, "reasoning_tokens": 100, "model_calls": 2}


def test_within_budget_the_model_is_called() -> None:
    assert boundary.over_budget(run_view(None, None), TABLE) is None
    assert boundary.over_budget(run_view({"model_calls": 3}, USAGE), TABLE) is None
    assert boundary.over_budget(run_view({"tokens": 1001}, USAGE), TABLE) is None
    # cost so far: 600 * 2 + 400 * 10 per 1M = 0.0052
    assert boundary.over_budget(run_view({"usd": 0.0053}, USAGE), TABLE) is None


@pytest.mark.parametrize(
    ("budget", "key", "used"),
    [
        ({"model_calls": 2}, "model_calls", 2),
        ({"tokens": 1000}, "tokens", 1000),
        ({"usd": 0.005}, "usd", pytest.approx(0.0052)),
        ({"tokens": 10**6, "model_calls": 1}, "model_calls", 2),
    ],
)
def test_a_reached_budget_fails_the_run_before_its_model_call(
    budget: dict[str, Any], key: str, used: Any
) -> None:
    transition = boundary.over_budget(run_view(budget, USAGE), TABLE)
    assert transition is not None
    assert transition.to is Phase.REPORT_FAILURE
    assert transition.model_calls == 0 and transition.usage is None  # no call was made
    assert transition.state is not None and transition.state["k"] == 1
    error = transition.state["error"]
    assert error["reason"] == "budget exceeded"
    assert error["budget"] == key and error["limit"] == budget[key] and error["used"] == used
    assert error["phase"] == "call_model" and error["type"] == "BudgetExceeded"
    assert error["usage"]["input_tokens"] == 600 and error["usage"]["model_calls"] == 2
    assert f"{key} budget exceeded" in error["message"]


def test_a_usd_budget_whose_price_went_away_stops_the_run() -> None:
    transition = boundary.over_budget(run_view({"usd": 1.0}, USAGE, model="openai:gone"), TABLE)
    assert transition is not None and transition.state is not None
    error = transition.state["error"]
    assert error["budget"] == "usd" and error["used"] is None
    assert "has no price in CHARLIE_PRICES" in error["message"]


def test_only_call_model_checks_the_budget() -> None:
    view = run_view({"model_calls": 1}, USAGE, phase=Phase.ADVANCE_TURN)
    assert boundary.over_budget(view, TABLE) is None


# -- delegation trees: a child's spend is its ancestors' --------------------------------------


def spend_of(
    task_id: str,
    parent: str | None,
    budget: dict[str, Any] | None,
    calls: int,
    tokens: int = 0,
    model: str = "openai:gpt-4o",
) -> TaskSpend:
    usage = {"input_tokens": tokens, "output_tokens": 0, "reasoning_tokens": 0}
    return TaskSpend(task_id, parent, model, budget, {**usage, "model_calls": calls})


def tree_view(task_id: str, tree: tuple[TaskSpend, ...]) -> RunView:
    me = next(t for t in tree if t.task_id == task_id)
    view = run_view(me.budget, me.usage)
    task = replace(view.task, id=task_id, parent_id=me.parent_id, tree=tree)
    return replace(view, task=task)


def test_a_childs_call_stops_when_its_parents_budget_is_spent_by_the_family() -> None:
    """Siblings each delegated with what their parent had left cannot together spend more
    than it: a child whose own budget has room stops once its parent's subtree reached the
    parent's limit, and the error names whose budget it was."""
    tree = (
        spend_of("p", None, {"model_calls": 5}, 1),
        spend_of("p.a", "p", {"model_calls": 4}, 2),
        spend_of("p.b", "p", {"model_calls": 4}, 2),
    )
    transition = boundary.over_budget(tree_view("p.a", tree), TABLE)
    assert transition is not None and transition.state is not None
    error = transition.state["error"]
    assert error["budget_of"] == "p" and error["used"] == 5 and error["limit"] == 5
    assert "the budget of task p" in error["message"]
    # with room above, its own budget is what counts
    roomy = (spend_of("p", None, {"model_calls": 50}, 1), *tree[1:])
    assert boundary.over_budget(tree_view("p.a", roomy), TABLE) is None
    # the parent's own check counts its children's spend, and says so
    transition = boundary.over_budget(tree_view("p", tree), TABLE)
    assert transition is not None and transition.state is not None
    assert "delegated tasks'" in transition.state["error"]["message"]


def test_a_tree_spend_prices_each_task_by_its_own_model() -> None:
    used = pricing.spent(
        [
            ("openai:gpt-4o", {"input_tokens": 10**6, "model_calls": 1}),
            ("openai:gpt-4o-mini", {"input_tokens": 10**6, "model_calls": 2}),
        ],
        TABLE,
    )
    assert used["model_calls"] == 3 and used["tokens"] == 2 * 10**6
    assert used["usd"] == pytest.approx(2.5)
    unpriced = pricing.spent([("openai:gone", {"input_tokens": 1})], TABLE)
    assert unpriced["usd"] is None and unpriced["unpriced"] == ["openai:gone"]


def test_a_childs_budget_is_the_least_left_above_it_within_the_defaults() -> None:
    tree = (
        spend_of("p", None, {"model_calls": 10, "tokens": 1000}, 3, tokens=400),
        spend_of("p.a", "p", {"model_calls": 7, "tokens": 600}, 2, tokens=100),
    )
    # p.a has 5 calls and 500 tokens of its own left; p has 10 - 5 and 1000 - 500
    assert child_budget(tree, "p.a", "openai:gpt-4o", {}, TABLE) == {
        "model_calls": 5,
        "tokens": 500,
    }
    defaults = {"model_calls": 2, "tokens": None, "usd": None}
    assert child_budget(tree, "p.a", "openai:gpt-4o", defaults, TABLE) == {
        "model_calls": 2,
        "tokens": 500,
    }
    # no budget above it: the defaults, as for any submit
    assert child_budget((spend_of("q", None, None, 1),), "q", "m", defaults, TABLE) == {
        "model_calls": 2
    }
    spent_tree = (spend_of("p", None, {"model_calls": 3}, 1), spend_of("p.a", "p", None, 2))
    with pytest.raises(DelegationRefused, match="model_calls budget is spent") as refused:
        child_budget(spent_tree, "p", "openai:gpt-4o", {}, TABLE)
    assert refused.value.details["budget_of"] == "p"
