"""Worker log lines carry their run's context (charlie/logs.py)."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest

from charlie import logs


@pytest.fixture
def captured() -> tuple[logging.Logger, io.StringIO]:
    """A logger whose handler has a format string of its own, as Celery's worker sets one."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("test.charlie.logs")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger, stream


def test_text_lines_keep_the_format_and_append_the_context_leading_keys_first(captured) -> None:
    logger, stream = captured
    logs.install(logger)
    logs.install(logger)  # idempotent: the context is not appended twice
    log = logging.getLogger("charlie.executor.tick")
    record = log.makeRecord(
        log.name,
        logging.INFO,
        __file__,
        1,
        "transition %s -> %s",
        ("a", "b"),
        None,
        extra={"note": "two words", "call_id": "c1", "task_id": "t1", "empty": None, "n": 3},
    )
    logger.handle(record)
    line = stream.getvalue().strip()
    assert line == (
        'INFO charlie.executor.tick: transition a -> b [task_id=t1 call_id=c1 note="two words" n=3]'
    )
    # The record itself is left as it was, for any other handler.
    assert record.getMessage() == "transition a -> b"


def test_records_of_other_libraries_are_untouched(captured) -> None:
    logger, stream = captured
    logs.install(logger)
    logger.info("task %s received", "x", extra={"data": {"id": "x"}})
    assert stream.getvalue().strip() == "INFO test.charlie.logs: task x received"


def test_the_traceback_follows_the_context(captured) -> None:
    logger, stream = captured
    logs.install(logger)
    log = logging.getLogger("charlie.tools.invoke")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = log.makeRecord(
            log.name,
            logging.ERROR,
            __file__,
            1,
            "handler raised",
            (),
            sys.exc_info(),
            extra={"call_id": "c9"},
        )
    logger.handle(record)
    first, *rest = stream.getvalue().splitlines()
    assert first == "ERROR charlie.tools.invoke: handler raised [call_id=c9]"
    assert rest[-1] == "RuntimeError: boom"


def test_json_lines_carry_the_context_as_fields(captured) -> None:
    logger, stream = captured
    logs.install(logger, json_lines=True)
    log = logging.getLogger("charlie.sweeps")
    logger.handle(
        log.makeRecord(
            log.name,
            logging.WARNING,
            __file__,
            1,
            "call %s interrupted",
            ("c2",),
            None,
            extra={"execution_id": "x-t1", "call_id": "c2", "evidence": {"attempts": 2}},
        )
    )
    entry = json.loads(stream.getvalue())
    assert entry["message"] == "call c2 interrupted"
    assert (entry["level"], entry["logger"]) == ("WARNING", "charlie.sweeps")
    assert (entry["execution_id"], entry["call_id"], entry["evidence"]) == (
        "x-t1",
        "c2",
        {"attempts": 2},
    )


def test_a_long_value_is_cut_in_text_lines() -> None:
    assert logs._text("x" * 1000).endswith("...")
    assert len(logs._text("x" * 1000)) == logs.MAX_VALUE_CHARS + 3


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("plain", "plain"),
        ("a=b", '"a=b"'),
        ('say "hi"', '"say \\"hi\\""'),
        ("no\u00a0break", '"no\\u00a0break"'),  # whitespace beyond ASCII is quoted too
        ("tab\there", '"tab\\there"'),
        # a look-alike of a space and of "=": one value, not two pairs
        ("t\u3164note\uff1dok", '"t\\u3164note\\uff1dok"'),
        ("caf\u00e9", '"caf\\u00e9"'),  # any non-ASCII character: quoted, escaped
        ("bell\x07", '"bell\\u0007"'),
        ("a-b_c.d/e:f@g~{}[]'!", "a-b_c.d/e:f@g~{}[]'!"),  # printable ASCII stays as it is
        ("", '""'),
        (3, "3"),
    ],
)
def test_a_value_is_quoted_unless_it_is_printable_non_space_ascii_without_quote_or_equals(
    value: object, shown: str
) -> None:
    assert logs._text(value) == shown


def test_odd_values_never_cost_the_line(captured) -> None:
    """Mixed or tuple keys, a cycle, NaN, nesting too deep for json or repr: written as their
    repr (or named), and the line is printed in both formats."""
    cycle: list[object] = []
    cycle.append(cycle)
    deep: list[object] = []
    for _ in range(100_000):
        deep = [deep]
    odd = {"mixed": {1: "a", "b": 2}, "tuple_key": {(1, 2): 3}, "cycle": cycle, "nan": float("nan")}
    for json_lines in (False, True):
        logger, stream = captured
        stream.seek(0)
        stream.truncate()
        logger.handlers[0].setFormatter(logging.Formatter("%(message)s"))
        logs.install(logger, json_lines=json_lines)
        log = logging.getLogger("charlie.odd")
        logger.handle(
            log.makeRecord(
                log.name, logging.INFO, __file__, 1, "odd", (), None, extra={**odd, "deep": deep}
            )
        )
        line = stream.getvalue().strip()
        assert line.startswith("odd [") or json.loads(line)["message"] == "odd"
        assert "NaN" not in line.replace("nan", "")  # not JSON's invalid NaN token
        if json_lines:
            entry = json.loads(line)
            assert entry["deep"] == "<unprintable list>"
            assert entry["nan"] == "nan" and entry["ts"].endswith("+00:00")
