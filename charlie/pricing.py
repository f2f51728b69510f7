"""Prices and budgets: what a task's tokens cost, and whether it may call its model
again. Pure: no SQL, no Celery, no settings read here; callers pass the table and the usage.

A price table maps a model spec, or a prefix of specs, to USD per million tokens::

    {"openai:gpt-4.1": {"input": 2.0, "output": 8.0},
     "openai:o4-": {"input": 1.1, "output": 4.4, "reasoning": 4.4}}

It comes from ``CHARLIE_PRICES`` (the JSON object inline, or the path of a JSON file). A spec
is priced by its exact entry, else by the longest key that is a prefix of it and ends at a
separator (one of ``: / - . _ @``): ``openai:gpt-4o`` prices only ``openai:gpt-4o``, while
``openai:gpt-4o-`` prices ``openai:gpt-4o-mini`` and ``openai:gpt-4o-2024-08-06`` alike (a
longer key for ``-mini`` wins over it). Built in: scripted models (``scripted:``) cost 0. No
real-world price is built in: a model missing from the table has no known cost.

Reasoning tokens: the OpenAI APIs report them as part of the output tokens (Charlie's clients
record both counts as reported), so a task's tokens are input + output, and its reasoning
tokens are priced at ``reasoning`` (default: the ``output`` price) instead of, not on top of,
the output price.

Prompt cache tokens, the same way: the input tokens read from a provider's prompt cache
(``cache_read_tokens``) and written to it (``cache_write_tokens``) are part of the input tokens
and priced at ``cache_read`` and ``cache_write`` (default: the ``input`` price) instead of it::

    {"anthropic:claude-sonnet-4-5": {"input": 3, "output": 15, "cache_read": 0.3,
                                     "cache_write": 3.75}}
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from charlie.jsonsetting import json_object

PRICES_SETTING = "CHARLIE_PRICES"
#: the kinds of budget, in the order the boundary checks them.
BUDGET_KEYS = ("model_calls", "tokens", "usd")
#: what a price table key may end at to be a prefix of specs.
SEPARATORS = frozenset(":/-._@")


class PriceError(ValueError):
    """CHARLIE_PRICES cannot be read or is not a price table."""


class BudgetError(ValueError):
    """A budget that cannot be used: an unknown key, a value that is not a positive number, a
    usd limit for a model with no price."""


@dataclass(frozen=True)
class Price:
    """USD per million tokens."""

    input: float
    output: float
    #: None: reasoning tokens cost what output tokens do.
    reasoning: float | None = None
    #: None: input tokens read from the prompt cache cost what other input tokens do.
    cache_read: float | None = None
    #: None: input tokens written to the prompt cache cost what other input tokens do.
    cache_write: float | None = None


BUILTIN_PRICES: dict[str, Price] = {"scripted:": Price(0.0, 0.0, 0.0)}
RATE_KEYS = ("input", "output", "reasoning", "cache_read", "cache_write")

PriceTable = Mapping[str, Price]


def _rate(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PriceError(f"{PRICES_SETTING}: {where} must be a number (USD per 1M tokens)")
    if value < 0:
        raise PriceError(f"{PRICES_SETTING}: {where} must not be negative, got {value}")
    return float(value)


def parse_prices(raw: str | None) -> dict[str, Price]:
    """The price table of a ``CHARLIE_PRICES`` value (inline JSON, or a JSON file's path),
    over the built-in one; a PriceError naming the setting when it cannot be used."""
    table = dict(BUILTIN_PRICES)
    if raw is None or not raw.strip():
        return table
    data = json_object(PRICES_SETTING, raw, PriceError, "model: price")
    for model, entry in data.items():
        if not model:
            raise PriceError(f"{PRICES_SETTING}: a model key is empty")
        if not isinstance(entry, dict):
            raise PriceError(
                f'{PRICES_SETTING}: {model!r} must be {{"input": N, "output": N}} '
                "(USD per 1M tokens)"
            )
        unknown = sorted(set(entry) - set(RATE_KEYS))
        if unknown:
            raise PriceError(
                f"{PRICES_SETTING}: {model!r} has unknown key(s) {', '.join(unknown)}; "
                "the keys are input, output, reasoning, cache_read and cache_write"
            )
        missing = [k for k in ("input", "output") if k not in entry]
        if missing:
            raise PriceError(f"{PRICES_SETTING}: {model!r} lacks {' and '.join(missing)}")
        optional = {
            key: None if entry.get(key) is None else _rate(entry[key], f"{model!r} {key}")
            for key in ("reasoning", "cache_read", "cache_write")
        }
        table[model] = Price(
            _rate(entry["input"], f"{model!r} input"),
            _rate(entry["output"], f"{model!r} output"),
            **optional,
        )
    return table


@functools.cache
def price_table(raw: str | None) -> PriceTable:
    """:func:`parse_prices`, once per value (a file is read once per process)."""
    return parse_prices(raw)


def price_for(model: str, table: PriceTable) -> Price | None:
    """The exact entry, else the longest key ending at a separator that prefixes ``model``."""
    # a framework agent's spec (``openai:gpt-4.1#agent=...``) is priced as its model
    model = model.partition("#")[0]
    exact = table.get(model)
    if exact is not None:
        return exact
    prefixes = [k for k in table if k and k[-1] in SEPARATORS and model.startswith(k)]
    return table[max(prefixes, key=len)] if prefixes else None


def total_tokens(input_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> int:
    """A task's tokens: reasoning tokens are part of the output tokens (see the module)."""
    del reasoning_tokens
    return int(input_tokens) + int(output_tokens)


def cost_usd(
    model: str,
    input_tokens: int,
    output_tokens: int,
    reasoning_tokens: int,
    table: PriceTable,
    *,
    cache_read_tokens: int = 0,
    cache_write_tokens: int = 0,
) -> float | None:
    """What the tokens cost in USD, or None when no price for ``model`` is known. Reasoning
    tokens are part of the output tokens, cache tokens part of the input tokens (see the
    module), each priced at its own rate instead."""
    price = price_for(model, table)
    if price is None:
        return None
    reasoning = max(0, min(int(reasoning_tokens), int(output_tokens)))
    plain = int(output_tokens) - reasoning
    reasoning_rate = price.output if price.reasoning is None else price.reasoning
    read = max(0, min(int(cache_read_tokens), int(input_tokens)))
    written = max(0, min(int(cache_write_tokens), int(input_tokens) - read))
    fresh = int(input_tokens) - read - written
    read_rate = price.input if price.cache_read is None else price.cache_read
    write_rate = price.input if price.cache_write is None else price.cache_write
    return (
        fresh * price.input
        + read * read_rate
        + written * write_rate
        + plain * price.output
        + reasoning * reasoning_rate
    ) / 1_000_000


# -- budgets ---------------------------------------------------------------------------------


def validate_budget(budget: object) -> dict[str, Any] | None:
    """A budget as stored: known keys only, positive limits (whole numbers for ``tokens`` and
    ``model_calls``); a key given as None has no limit. None or {}: no budget."""
    if budget is None:
        return None
    if not isinstance(budget, Mapping):
        raise BudgetError('budget must be an object like {"tokens": N, "usd": X, "model_calls": K}')
    unknown = sorted(str(k) for k in budget if k not in BUDGET_KEYS)
    if unknown:
        raise BudgetError(
            f"unknown budget key(s) {', '.join(unknown)}; the keys are tokens, usd, model_calls"
        )
    out: dict[str, Any] = {}
    for key in BUDGET_KEYS:
        value = budget.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BudgetError(f"budget {key} must be a number, got {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise BudgetError(f"budget {key} must be positive, got {value!r}")
        if key == "usd":
            out[key] = float(value)
        else:
            if value != int(value):
                raise BudgetError(f"budget {key} must be a whole number, got {value!r}")
            out[key] = int(value)
    return out or None


def with_defaults(budget: object, defaults: Mapping[str, Any]) -> dict[str, Any] | None:
    """The budget a task is stored with: the given limits, and the defaults (settings) for the
    keys not given; a key given as None opts out of its default."""
    validate_budget(budget)  # an object of known keys and good values, or None
    merged: dict[str, Any] = {k: v for k, v in defaults.items() if v is not None}
    if isinstance(budget, Mapping):
        merged.update(budget)
    return validate_budget(merged)


def check_priced(budget: Mapping[str, Any] | None, model: str, table: PriceTable) -> None:
    """A usd limit needs a price for the task's model: refused (before anything is written)
    otherwise."""
    if budget and budget.get("usd") is not None and price_for(model, table) is None:
        raise BudgetError(
            f"a usd budget needs a price for model {model!r}, and none is known: add it to "
            f"{PRICES_SETTING} (for example "
            f'{{"{model}": {{"input": USD_PER_1M, "output": USD_PER_1M}}}}) or give a tokens '
            "or model_calls budget instead"
        )


def usage_of(usage: Mapping[str, Any], model: str, table: PriceTable) -> dict[str, Any]:
    """What a budget counts, from the durable usage (tokens and model calls)."""
    return spent([(model, usage)], table)


#: one task's part of a spend: its model and its durable usage (input/output/reasoning tokens,
#: model_calls).
Part = tuple[str, Mapping[str, Any]]


def spent(parts: Iterable[Part], table: PriceTable) -> dict[str, Any]:
    """What a budget counts over one task or several (a task and the tasks it delegated, whose
    spend counts against its budget): model calls and tokens summed, and USD with each task's
    tokens priced by its own model. ``usd`` is None when a model among them has no price, so
    such a spend cannot be checked against a usd limit; ``unpriced`` names those models."""
    totals = {
        "input_tokens": 0,
        "output_tokens": 0,
        "reasoning_tokens": 0,
        "cache_read_tokens": 0,
        "cache_write_tokens": 0,
        "model_calls": 0,
    }
    usd: float | None = 0.0
    unpriced: list[str] = []
    for model, usage in parts:
        i = int(usage.get("input_tokens") or 0)
        o = int(usage.get("output_tokens") or 0)
        r = int(usage.get("reasoning_tokens") or 0)
        cr = int(usage.get("cache_read_tokens") or 0)
        cw = int(usage.get("cache_write_tokens") or 0)
        totals["input_tokens"] += i
        totals["output_tokens"] += o
        totals["reasoning_tokens"] += r
        totals["cache_read_tokens"] += cr
        totals["cache_write_tokens"] += cw
        totals["model_calls"] += int(usage.get("model_calls") or 0)
        cost = cost_usd(model, i, o, r, table, cache_read_tokens=cr, cache_write_tokens=cw)
        if cost is None:
            if model not in unpriced:
                unpriced.append(model)
        elif usd is not None:
            usd += cost
    return {
        **totals,
        "tokens": total_tokens(totals["input_tokens"], totals["output_tokens"]),
        "usd": None if unpriced else usd,
        "unpriced": unpriced,
    }


def exceeded(
    budget: Mapping[str, Any] | None,
    usage: Mapping[str, Any],
    model: str,
    table: PriceTable,
) -> dict[str, Any] | None:
    """The first budget the usage has reached (the next model call would start past it), as
    the error a task fails with; None while every limit has room. A usd limit whose model has
    no price (it was removed from the table after submit) cannot be checked: it counts as
    reached, so spending never goes on unmetered."""
    return exceeded_by(budget, spent([(model, usage)], table))


def exceeded_by(budget: Mapping[str, Any] | None, used: Mapping[str, Any]) -> dict[str, Any] | None:
    """:func:`exceeded` for a spend already summed (:func:`spent`): one task's, or a task's
    and its delegated tasks'."""
    if not budget:
        return None
    shown = {
        "input_tokens": used["input_tokens"],
        "output_tokens": used["output_tokens"],
        "reasoning_tokens": used["reasoning_tokens"],
        "model_calls": used["model_calls"],
        "cost_usd": used["usd"],
    }
    for key in BUDGET_KEYS:
        limit = budget.get(key)
        if limit is None:
            continue
        amount = used[key]
        if amount is None:
            models = used.get("unpriced") or []
            named = (
                f"model {models[0]!r} has"
                if len(models) == 1
                else f"models {', '.join(map(repr, models))} have"
            )
            return {
                "reason": "budget exceeded",
                "budget": key,
                "limit": limit,
                "used": None,
                "usage": shown,
                "message": (
                    f"the usd budget ({limit}) cannot be checked: {named} no price in "
                    f"{PRICES_SETTING}; add one, then resume the task"
                ),
            }
        if amount >= limit:
            what = {"model_calls": "model calls", "tokens": "tokens", "usd": "USD"}[key]
            shown_amount = f"{amount:.6f}" if key == "usd" else str(amount)
            return {
                "reason": "budget exceeded",
                "budget": key,
                "limit": limit,
                "used": amount,
                "usage": shown,
                "message": (
                    f"{key} budget exceeded: {shown_amount} {what} used of a limit of {limit}; "
                    "the model was not called again"
                ),
            }
    return None


def left_of(budget: Mapping[str, Any], used: Mapping[str, Any]) -> dict[str, Any]:
    """What is left of each limit of ``budget`` after the spend ``used`` (zero or less: spent;
    None: a usd limit that cannot be checked, see :func:`spent`)."""
    left: dict[str, Any] = {}
    for key in BUDGET_KEYS:
        limit = budget.get(key)
        if limit is None:
            continue
        amount = used[key]
        left[key] = None if amount is None else limit - amount
    return left


def describe(
    budget: Mapping[str, Any] | None, usage: Mapping[str, Any], model: str, table: PriceTable
) -> list[tuple[str, Any, Any]]:
    """(key, used, limit) for each limit of a budget, for people to read."""
    if not budget:
        return []
    used = usage_of(usage, model, table)
    return [(k, used[k], budget[k]) for k in BUDGET_KEYS if budget.get(k) is not None]
