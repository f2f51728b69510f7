"""Text that did not come from Charlie is shown, never obeyed, by a terminal (charlie.terminal):
the rule itself, and the worker's text log lines that quote a model's or a tool's text."""

from __future__ import annotations

import io
import json
import logging
import sys
import unicodedata

import pytest

from charlie import logs
from charlie.terminal import printable

HOSTILE = {
    "\x1b]52;c;aGk=\x07": "\\x1b]52;c;aGk=\\x07",  # OSC 52: writes the clipboard
    "\x1b[2J": "\\x1b[2J",  # clears the screen
    "a\rb": "a\\rb",  # CR: overwrites the line
    "a\x08b": "a\\x08b",  # backspace
    "\x9b31m": "\\x9b31m",  # the 8-bit CSI, a sequence without ESC
    "\x7f": "\\x7f",  # DEL
    "\x85": "\\x85",  # NEL, a C1 newline
    "abc\u202edef": "abc<U+202E>def",  # RIGHT-TO-LEFT OVERRIDE
    "\u2066x\u2069": "<U+2066>x<U+2069>",  # bidi isolates
    "\u200e\u200f": "<U+200E><U+200F>",  # LRM, RLM
    "a\u200bb": "a<U+200B>b",  # zero-width space
    "\ufeff": "<U+FEFF>",  # BOM
    "\U000e0041": "<U+E0041>",  # a tag character (invisible text)
    "a\u2028b": "a<U+2028>b",  # line separator
    "\ud800": "<U+D800>",  # a lone surrogate: would not even encode
}


@pytest.mark.parametrize(("raw", "shown"), sorted(HOSTILE.items()))
def test_every_control_and_format_character_is_shown(raw: str, shown: str) -> None:
    assert printable(raw) == shown
    assert printable(raw, multiline=True) == shown


def test_newlines_are_kept_only_in_a_body_and_tabs_always() -> None:
    assert printable("one\ntwo\tthree") == "one\\ntwo\tthree"
    assert printable("one\ntwo\tthree", multiline=True) == "one\ntwo\tthree"
    assert printable("one\r\ntwo", multiline=True) == "one\\r\ntwo"


def test_ordinary_text_is_left_as_it_is() -> None:
    for text in ("plain ascii", "naïve café — ok “quoted” 日本語 🙂", "C:\\path\\x1b", ""):
        assert printable(text) == text


def test_nothing_a_terminal_obeys_is_left_in_any_code_point() -> None:
    every = "".join(chr(c) for c in range(0x110000))
    shown = printable(every, multiline=True)
    left = {unicodedata.category(ch) for ch in shown if ch not in "\n\t"}
    assert not left & {"Cc", "Cf", "Cs", "Zl", "Zp"}


def test_text_log_lines_show_the_controls_of_a_message_and_its_context() -> None:
    """A worker's log line that quotes a tool's error or a model's text shows its controls; a
    traceback keeps its lines; JSON lines escape them as JSON does."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("test.charlie.terminal")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logs.install(logger)
    log = logging.getLogger("charlie.tool")
    evil = "boom\x1b]52;c;aGk=\x07\r\u202e"
    try:
        raise RuntimeError(evil)
    except RuntimeError:
        record = log.makeRecord(
            log.name, logging.WARNING, __file__, 1, "tool failed: %s", (evil,), None
        )
        record.exc_info = sys.exc_info()
    record.call_id = "c\x1b[2J"
    record.result = "x\x9by"
    logger.handle(record)
    line = stream.getvalue()
    assert "tool failed: boom\\x1b]52;c;aGk=\\x07\\r<U+202E>" in line, line
    # (a context value with a control in it is quoted, JSON-escaped: one value, shown)
    assert 'call_id="c\\u001b[2J"' in line and 'result="x\\u009by"' in line, line
    assert "RuntimeError: boom\\x1b]52" in line and line.count("\n") > 2  # the traceback's lines
    assert not [ch for ch in line if ch not in "\n\t" and unicodedata.category(ch)[0] == "C"]

    json_stream = io.StringIO()
    handler.stream = json_stream
    logs.install(logger, json_lines=True)
    logger.handle(record)
    text = json_stream.getvalue()
    assert not [ch for ch in text.rstrip("\n") if unicodedata.category(ch)[0] == "C"]
    assert json.loads(text)["message"] == f"tool failed: {evil}"
