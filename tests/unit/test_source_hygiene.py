"""Comments and docstrings name their reasons (the invariant, the documented section, the
behaviour), never a tracker number, and no file names a path on the machine it was written on.

A tracker number says nothing to a reader who has not got the tracker, and goes stale when the
tracker moves; a machine path names a checkout that exists only on one machine. Both crept back
once after being cleaned out, so this test reads every source file of the repository's code,
tests and scripts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.backend_free

ROOT = Path(__file__).resolve().parents[2]

#: What is read: the package, its tests, the scripts, CI, the docs and the top-level files.
SCANNED = (
    "charlie", "tests", "scripts", ".ci", "docs", "README.md", "CONTRIBUTING.md", "celeryconfig.py",
    "pyproject.toml", "mkdocs.yml", "docker-compose.yml",
)  # fmt: skip
SUFFIXES = {".py", ".toml", ".ini", ".cfg", ".sh", ".html", ".js", ".css", ".md", ".txt", ""}

#: Built from pieces, so this file does not match itself.
FORBIDDEN = {
    "a tracker number": re.compile(r"\b[Ii]ssues?[\s#]+\d"),
    "a tracker item": re.compile(r"\((?:[^()]*[;,] )?items? \d+\b"),
    "a machine path": re.compile("/" + "work/|" + r"\.\./" + "shared/"),
}


def _files() -> list[Path]:
    found: list[Path] = []
    for name in SCANNED:
        path = ROOT / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        for file in candidates:
            if not file.is_file() or "__pycache__" in file.parts:
                continue
            if file.suffix in SUFFIXES and file.resolve() != Path(__file__).resolve():
                found.append(file)
    return found


def offences(text: str) -> list[tuple[str, int, str]]:
    """What in ``text`` names a tracker or a machine path: (what, line number, the match)."""
    found = []
    for what, pattern in FORBIDDEN.items():
        for match in pattern.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((what, line, match.group(0)))
    return found


def test_the_patterns_catch_what_they_are_for() -> None:
    caught = "\n".join(
        [
            "# (" + "issue 17) the fused commit",
            '"""' + "Issue 12 item 5: a lease",
            "# logs (" + "issue\n# 15 item 5)",
            "# crashes (" + "item 1).",
            "see " + "/" + "work/shared/design/notes.md",
            "see " + "../" + "shared/design/",
        ]
    )
    assert len({line for _, line, _ in offences(caught)}) == 6
    assert offences("# an issue with the lease (I5); items 1 to 3 of the list") == []


def test_no_source_file_names_a_tracker_number_or_a_machine_path() -> None:
    files = _files()
    assert any(f.name == "tick.py" for f in files)  # the scan reads the package
    found = [
        f"{file.relative_to(ROOT)}:{line}: {what} ({match!r})"
        for file in files
        for what, line, match in offences(file.read_text(errors="replace"))
    ]
    assert not found, (
        "name the invariant, the documented section or the behaviour instead:\n" + "\n".join(found)
    )
