"""Text that did not come from Charlie, made safe to print on an operator's terminal.

A model's answer, a tool's result, a question, an MCP server's error, an argument a model made
up: any of them can carry control characters that a terminal obeys rather than shows. OSC 52
writes the clipboard, ``ESC [2J`` clears the screen (hiding the lines above an approval), CR and
backspace overwrite what was printed, the 8-bit CSI (U+009B) starts a sequence without ESC, and
bidi controls such as U+202E reorder the text around them. :func:`printable` renders every such
character visibly, so the operator reads what was there and the terminal obeys nothing.

What is made visible: every character of the Unicode categories Cc (C0 controls, DEL, the C1
controls U+0080-U+009F), Cf (format: bidi embeddings, overrides and isolates, LRM/RLM, zero-width
characters, the BOM, tag characters), Cs (lone surrogates, which would also make the output
fail to encode), Zl and Zp (line and paragraph separators). ``\\t`` is kept; ``\\n`` is kept only
in a multi-line body, and shown as ``\\n`` in a one-line field, so model text can never start a
line that looks like Charlie's own.

How: ``\\n``, ``\\r``, ``\\t`` as those two characters; other C0, DEL and C1 as ``\\xNN``; anything
else as ``<U+XXXX>``. A text that already contains those spellings shows the same: harmless,
since nothing is obeyed either way.
"""

from __future__ import annotations

import unicodedata
from functools import cache

#: the Unicode categories a terminal may act on or that display as nothing.
UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


@cache
def _visible(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code <= 0xFF else f"<U+{code:04X}>"


def _unsafe(ch: str) -> bool:
    # printable ASCII is by far the common case: decided without a table look-up
    return not (" " <= ch <= "~") and unicodedata.category(ch) in UNSAFE_CATEGORIES


def printable(text: str, *, multiline: bool = False) -> str:
    """``text`` with every control and format character shown instead of obeyed.

    ``multiline``: a body printed on lines of its own keeps its newlines (never its CRs);
    otherwise (a field within one line) a newline is shown as ``\\n`` too. Tabs are kept."""
    if text.isascii() and text.isprintable():
        return text  # no control character at all (isprintable is False for \t and \n too)
    keep = "\t\n" if multiline else "\t"
    return "".join(_visible(ch) if ch not in keep and _unsafe(ch) else ch for ch in text)
