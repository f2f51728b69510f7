"""The fused statements' text (charlie/store/fused.py): what is sent is what was written,
whitespace aside, and a steady turn's statements stay short enough for psycopg to cache its
parse of their placeholders (it parses a longer one again at every execution)."""

from __future__ import annotations

import itertools
import re

import pytest

from charlie.store import fused

#: psycopg's limit (psycopg._queries.MAX_CACHED_STATEMENT_LENGTH, 4,096 bytes in 3.1 to 3.3)
CACHED_LENGTH = 4096

SHAPES = list(itertools.product([False, True], repeat=8))


@pytest.mark.parametrize("shape", SHAPES[::17] + SHAPES[-1:])
def test_a_statement_is_sent_with_each_run_of_whitespace_one_space(shape) -> None:
    sql = fused._statement(*shape)
    assert not re.search(r"\s\s|[\n\t]", sql)
    assert sql == sql.strip()
    # the literals and placeholders are all there, as written
    assert "'null'::jsonb" in sql
    assert "%(id)s" in sql and "%(what)s" in sql


def test_a_steady_turns_statements_fit_psycopgs_parse_cache() -> None:
    """A one-call turn's two commits (docs/benchmarks.md, "What a turn costs"): A, the model's
    output (the carried claim, its state, items, the call, the usage on the task), and B, the
    settle and the next model call's claim (its state, the result item, the settle)."""
    a = fused._statement(True, True, True, True, False, False, True)
    b = fused._statement(False, True, True, False, True, False, False)
    for sql in (a, b):
        assert len(sql.encode()) <= CACHED_LENGTH


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT 1 -- why\nFROM t",
        "SELECT /* why */ 1",
        "SELECT 'two  words' FROM t",
        "SELECT 'it''s\tthis' FROM t",
    ],
)
def test_a_statement_whose_whitespace_cannot_be_collapsed_is_refused(sql: str) -> None:
    """Collapsing whitespace changes nothing only without comments and without a literal
    that holds whitespace: a statement with either is refused when first built, not sent
    changed."""
    with pytest.raises(ValueError, match="cannot be collapsed"):
        fused._compact(sql)


def test_every_shape_is_built() -> None:
    """No shape of the fused statement holds a comment or a literal with whitespace."""
    for shape in SHAPES:
        assert fused._statement(*shape)
    assert fused._compact("SELECT 'null'::jsonb,\n  'it''s'") == "SELECT 'null'::jsonb, 'it''s'"
